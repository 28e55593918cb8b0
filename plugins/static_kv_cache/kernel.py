"""The static cache's decode attention (``decode_attention.cpp``), built on first use.

Registers ``torch.ops.nxdplug_static_kv_cache.decode_attention`` and its paged twin
``paged_decode_attention`` (keys and values in blocks through a block table), one library built
by :mod:`nxdplug.runtime.cpp_ops`; a process that loads a compiled graph calling them needs them
registered first: building the cache does that. Where it cannot be built, the cache reads its
lines for the model's own attention instead, after a warning.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from nxdplug.plugin_api import build_operator

SOURCE = Path(__file__).with_name("decode_attention.cpp")
LIBRARY = "nxdplug_static_kv_cache"
# The dtypes the kernel takes (q and the caches alike).
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def decode_attention_op() -> Any | None:
    """``decode_attention(q [batch, heads, queries, dim], k_cache, v_cache [lines, kv_heads,
    positions, dim], seq_ids [batch], mask [batch, 1, queries, keys] bool, scale)`` -> q's
    shape and dtype; None where the extension cannot be built."""
    return build_operator(
        LIBRARY,
        SOURCE,
        "decode_attention",
        _output_like,
        purpose="decode attention",
        instead="decoding gathers each row's cache for the model's attention instead, "
        "which is slower",
    )


@functools.cache
def paged_decode_attention_op() -> Any | None:
    """``paged_decode_attention(q [batch, heads, queries, dim], k_blocks, v_blocks [blocks,
    kv_heads, block_size, dim], block_tables [batch, blocks_per_row] int64, mask [batch, 1,
    queries, keys <= blocks_per_row * block_size] bool, scale)`` -> q's shape and dtype: row b's
    position j lies in block ``block_tables[b, j // block_size]`` at ``j % block_size``; None
    where the extension cannot be built. The library is decode_attention_op's: built (or found
    built) once, loaded once, this operator's fake registered here."""
    return build_operator(
        LIBRARY,
        SOURCE,
        "paged_decode_attention",
        _paged_output_like,
        purpose="paged decode attention",
        instead="decoding gathers each row's blocks for the model's attention instead, "
        "which is slower",
    )


def _output_like(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_ids: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _paged_output_like(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)
