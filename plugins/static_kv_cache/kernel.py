"""The static cache's decode attention (``decode_attention.cpp``), built on first use.

Registers ``torch.ops.nxdplug_static_kv_cache.decode_attention`` (built by
:mod:`nxdplug.runtime.cpp_ops`); a process that loads a compiled graph calling it needs it
registered first: building the cache does that. Where it cannot be built, the cache reads its
lines for the model's own attention instead, after a warning.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from nxdplug.runtime.cpp_ops import build_operator

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


def _output_like(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_ids: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)
