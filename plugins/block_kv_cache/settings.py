"""The block layout's settings, read once from a NeuronConfig, with NxD Inference's names.

``is_block_kv_layout`` switches the layout on; ``pa_block_size`` positions make a block and
``pa_num_blocks`` blocks make the cache (by default as many as the lines would take:
``max_batch_size x seq_len / pa_block_size``). ``is_prefix_caching`` lets requests share the
blocks of a common prompt prefix; ``is_chunked_prefill`` (or NxD Inference's
``chunked_prefill_config``) encodes long prompts in chunks beside the running requests'
decoding. Either adds the extension phases (new tokens over a row's cached positions), one per
context-encoding bucket.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from nxdplug.plugin_api import NeuronConfig

ENABLED_BY = ("is_block_kv_layout",)
# The step input (and keyword) holding each row's blocks.
BLOCK_TABLES = "block_tables"
# What works over blocks only; each enables the feature, whose checks refuse it without them.
USES_BLOCKS = ("is_prefix_caching", "is_chunked_prefill", "chunked_prefill_config")
DEFAULT_BLOCK_SIZE = 32
SETTINGS: dict[str, Any] = {
    "is_block_kv_layout": False,
    "pa_num_blocks": None,
    "max_num_batched_tokens": None,
    "pa_block_size": DEFAULT_BLOCK_SIZE,
    "is_prefix_caching": False,
    "is_chunked_prefill": False,
    "prefix_buckets": None,
}


@attrs.frozen
class BlockSettings:
    block_size: int
    num_blocks: int
    blocks_per_line: int  # the blocks one sequence of seq_len positions takes
    prefix_caching: bool
    chunked_prefill: bool

    @classmethod
    def of(cls, neuron_config: NeuronConfig) -> BlockSettings:
        block_size = getattr(neuron_config, "pa_block_size", None) or DEFAULT_BLOCK_SIZE
        blocks_per_line = math.ceil(neuron_config.seq_len / block_size)
        num_blocks = getattr(neuron_config, "pa_num_blocks", None)
        if num_blocks is None:
            num_blocks = neuron_config.max_batch_size * blocks_per_line
        return cls(
            block_size=block_size,
            num_blocks=num_blocks,
            blocks_per_line=blocks_per_line,
            prefix_caching=bool(getattr(neuron_config, "is_prefix_caching", False)),
            chunked_prefill=bool(getattr(neuron_config, "is_chunked_prefill", False))
            or neuron_config.chunked_prefill_config is not None,
        )

    @property
    def null_block(self) -> int:
        """The block past the pool: table entries no block is lent to point at it, and the keys
        and values of padding tokens are written there; nothing real is ever read from it."""
        return self.num_blocks

    @property
    def extends(self) -> bool:
        """Whether rows may add tokens over cached positions (the extension phases)."""
        return self.prefix_caching or self.chunked_prefill
