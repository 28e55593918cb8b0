"""The block layout's checks and its extension phases."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from nxdplug.plugin_api import ExtendWrapper, ModelWrapper
from nxdplug.plugins.block_kv_cache.settings import USES_BLOCKS, BlockSettings

if TYPE_CHECKING:
    from nxdplug.plugin_api import NeuronConfig, PipelineContext

# Features whose caches or phases do not read through block tables (yet), refused by name.
NOT_WITH_BLOCKS = {
    "flash_decoding_enabled": "flash decoding lays its cache out over ranks by position",
    "is_medusa": "Medusa's tree phases are not built over block tables",
    "enable_eagle_speculation": "EAGLE's fused draft keeps a line cache of its own",
    "sequence_parallel_enabled": "sequence parallelism splits prompts, not chunks over a prefix",
}


def validate(context: PipelineContext) -> Iterable[str]:
    """The numbers the layout needs, checked at start-up, each saying what to change."""
    nc = context.neuron_config
    if not getattr(nc, "is_block_kv_layout", False):
        given = [name for name in USES_BLOCKS if getattr(nc, name, False)]
        yield (
            f"{' and '.join(given)} need the block KV-cache layout (NxD Inference's rule): set "
            "is_block_kv_layout=True (nxdplug serve: --enable-block-kv-layout)"
        )
        return
    size, count = getattr(nc, "pa_block_size", None), getattr(nc, "pa_num_blocks", None)
    if size is not None and (not isinstance(size, int) or size < 1):
        yield f"pa_block_size={size!r}: expected a positive number of positions per block"
        return
    if count is not None and (not isinstance(count, int) or count < 1):
        yield f"pa_num_blocks={count!r}: expected a positive number of blocks"
        return
    settings = BlockSettings.of(nc)
    if settings.num_blocks < settings.blocks_per_line:
        yield (
            f"pa_num_blocks={settings.num_blocks} cannot hold one request of seq_len={nc.seq_len}"
            f" positions (max_context_length plus max_tokens), which takes "
            f"{settings.blocks_per_line} blocks of pa_block_size={settings.block_size}; raise "
            f"pa_num_blocks to at least {settings.blocks_per_line} or lower seq_len"
        )
    buckets = nc.token_generation_buckets if nc.enable_bucketing else None
    widths = list(buckets or [nc.seq_len])
    prefixes = getattr(nc, "prefix_buckets", None)
    if prefixes is not None and not settings.extends:
        yield (
            "prefix_buckets size the extension graphs, which only is_prefix_caching or "
            "is_chunked_prefill adds: set one of them, or drop prefix_buckets"
        )
    for prefix in prefixes or ():
        widths += [min(prefix + size, nc.seq_len) for size in new_token_sizes(nc)]
    uneven = sorted({b for b in widths if b % settings.block_size})
    if uneven:
        yield (
            f"pa_block_size={settings.block_size} does not divide the cache widths {uneven} (the "
            "token-generation buckets or seq_len, and each prefix bucket plus a context-encoding "
            "bucket): each width reads whole blocks; choose buckets that are multiples of the "
            "block size, or a block size dividing them"
        )
    for attribute, why in NOT_WITH_BLOCKS.items():
        if getattr(nc, attribute, None):
            yield f"is_block_kv_layout with {attribute} is not implemented: {why}"
    budget = getattr(nc, "max_num_batched_tokens", None)
    if budget is not None and (not isinstance(budget, int) or budget < nc.max_batch_size):
        yield (
            f"max_num_batched_tokens={budget!r} is below max_batch_size={nc.max_batch_size}: "
            "each step's budget goes to the decoding requests first (one token each), so "
            "prompts could wait forever; give at least max_batch_size"
        )
    chunked = nc.chunked_prefill_config
    if chunked is not None and not chunked.tkg_model_enabled:
        yield (
            "chunked_prefill_config.tkg_model_enabled=False is not supported: decoding keeps "
            "the token-generation graph, faster than a chunk graph given one real token a row"
        )
    if not nc.is_continuous_batching and settings.extends:
        yield (
            "is_prefix_caching and is_chunked_prefill serve requests through the engine, which "
            "needs is_continuous_batching=True"
        )


def add_submodels(context: PipelineContext) -> Iterable[ModelWrapper]:
    """With prefix caching or chunked prefill, an extension phase per context-encoding bucket
    (the sizes of new tokens a row adds over its cached positions)."""
    nc = context.neuron_config
    if not getattr(nc, "is_block_kv_layout", False) or not BlockSettings.of(nc).extends:
        return []
    prefixes = getattr(nc, "prefix_buckets", None)
    chunked = nc.chunked_prefill_config
    rows = None if chunked is None else chunked.max_num_seqs
    return [
        ExtendWrapper(
            context.config,
            context.model_cls,
            size,
            None if prefixes is None else sorted({min(p + size, nc.seq_len) for p in prefixes}),
            batch_size=rows,
        )
        for size in new_token_sizes(nc)
    ]


def new_token_sizes(nc: NeuronConfig) -> list[int]:
    """The extension phases' sizes of new tokens: the context-encoding buckets; with chunked
    prefill only those up to the first that holds a step's budget (no chunk is larger)."""
    sizes = sorted((nc.context_encoding_buckets if nc.enable_bucketing else None) or [])
    sizes = sizes or [nc.max_context_length]
    budget = getattr(nc, "max_num_batched_tokens", None)
    if BlockSettings.of(nc).chunked_prefill and isinstance(budget, int):
        holding = [size for size in sizes if size >= budget]
        sizes = [size for size in sizes if size < budget] + holding[:1]
    return sizes
