"""Flash decoding's configuration rules, its ``kv`` process groups, and the model change: a
KV cache holding a share of the positions, and every attention layer attending over it."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import attrs
from torch import nn

from nxdplug.plugin_api import (
    ConfigError,
    NeuronAttentionBase,
    claim_slot,
    group_rank,
    group_size,
)
from nxdplug.plugins.flash_decoding.attention import GROUP, SequenceSplitAttention, held_length

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, PipelineContext


def _head_counts(config: InferenceConfig) -> tuple[int, int]:
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads


def validate(context: PipelineContext) -> Iterator[str]:
    tp_degree = context.neuron_config.tp_degree
    heads, kv_heads = _head_counts(context.config)
    if tp_degree <= kv_heads or tp_degree % kv_heads:
        yield (
            f"flash_decoding_enabled splits each K/V head's cache over the ranks that share it: "
            f"tp_degree ({tp_degree}) must be a multiple of num_key_value_heads ({kv_heads}) "
            "and larger; raise tp_degree or set flash_decoding_enabled=False"
        )
    if heads % tp_degree:
        yield (
            f"flash_decoding_enabled needs num_attention_heads ({heads}) divisible by "
            f"tp_degree ({tp_degree}) (no padded query heads)"
        )
    if context.selection.speculation_mode is not None:
        yield (
            "flash_decoding_enabled with speculation is not implemented (speculation moves "
            "accepted positions within the cache, which this layout deals out over ranks); "
            "set one of them off"
        )


def ranks_sharing_a_kv_head(world_size: int, config: InferenceConfig) -> list[range]:
    """Consecutive blocks of ``tp_degree / num_key_value_heads`` ranks: the ranks whose query
    heads use the same K/V head (one block of one rank each without a launch)."""
    _, kv_heads = _head_counts(config)
    size = world_size // kv_heads if world_size > kv_heads else 1
    return [range(start, start + size) for start in range(0, world_size, size)]


def split_cache_over_kv_groups(model: nn.Module, context: PipelineContext) -> None:
    """Give ``model`` a KV cache of this rank's share of the positions (plus a spare slot that
    takes the writes of positions other ranks hold) and its attention layers the
    :class:`SequenceSplitAttention` over it. In one process nothing changes, and a warning
    says so."""
    size = group_size(GROUP)
    if size == 1:
        warnings.warn(
            "flash_decoding_enabled: this process holds the whole model (no launched ranks "
            "share a K/V head), so every position stays in its cache; launch tp_degree ranks "
            "to split it",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    layers = [m for m in model.modules() if isinstance(m, NeuronAttentionBase)]
    for layer in layers:
        if type(layer).attend is not NeuronAttentionBase.attend:
            raise ConfigError(
                [
                    f"flash_decoding_enabled: {type(layer).__name__} weighs keys its own way "
                    "(its attend() is overridden), which the split attention does not "
                    "reproduce; set flash_decoding_enabled=False"
                ]
            )
    layout = model.kv_mgr.layout
    held = held_length(layout.max_length, size)
    kv_mgr = context.kv_cache(attrs.evolve(layout, max_length=held + 1))
    claim_slot(model, "kv_mgr", kv_mgr, claimant="flash-decoding")
    split = SequenceSplitAttention(rank=group_rank(GROUP), size=size, spare_slot=held)
    for layer in layers:
        claim_slot(layer, "cache_attention", split, claimant="flash-decoding")
