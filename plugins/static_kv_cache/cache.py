"""The static KV cache: per layer, K and V buffers of [max_batch, kv_heads, seq_len, head_dim]."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from nxdplug.plugin_api import (
    CacheLayout,
    KVCacheManager,
    NxdPlugError,
    read_prefix,
    write_positions,
)
from nxdplug.plugins.static_kv_cache.kernel import DTYPES, decode_attention_op

# Up to this many queries a row (decoding, speculation, prompts of up to 128 positions) attend
# with the plugin's kernel, which reads each row's line in place; longer prompts gather their
# lines for the model's attention. The kernel keeps a task's scores whole (query heads x queries
# x keys floats), and took 58 / 206 / 796 us against the gathering attention's 138 / 357 / 1175
# for one prompt of 64 / 128 / 256 positions (12 heads, 4 K/V heads of 64, bf16, eager).
KERNEL_MAX_QUERIES = 128
# NXDPLUG_DECODE_ATTENTION=gather leaves decoding to the model's attention too (to compare, or
# to rule the kernel out); read when a model is run eagerly or traced for compiling.
SWITCH = "NXDPLUG_DECODE_ATTENTION"


class StaticKVCache(KVCacheManager):
    def __init__(self, layout: CacheLayout) -> None:
        super().__init__(layout)
        shape = (layout.max_batch_size, layout.num_kv_heads, layout.max_length, layout.head_dim)
        for layer in range(layout.num_layers):
            self.register_buffer(f"k_{layer}", torch.zeros(shape, dtype=layout.dtype), False)
            self.register_buffer(f"v_{layer}", torch.zeros(shape, dtype=layout.dtype), False)
        # Registers the kernel now: a compiled graph that calls it can only be loaded once it is.
        decode_attention_op()

    def update_and_read(
        self,
        layer: int,
        key: torch.Tensor,
        value: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor,
        length: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache, v_cache = self._layer(layer)
        write_positions(k_cache, seq_ids, position_ids, key)
        write_positions(v_cache, seq_ids, position_ids, value)
        keys = read_prefix(k_cache, seq_ids, length).to(key.dtype)
        values = read_prefix(v_cache, seq_ids, length).to(value.dtype)
        return keys, values

    def store_and_attend(
        self,
        layer: int,
        q: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor,
    ) -> torch.Tensor | None:
        """Up to KERNEL_MAX_QUERIES queries a row on the CPU, in the cache's own float32 or
        bfloat16: the kernel reads the positions each row's mask lets it see, where they are
        (``decode_attention``), instead of a copy of every row's line up to the bucket's width."""
        k_cache, v_cache = self._layer(layer)
        kernel = usable_kernel(decode_attention_op, q, k_cache.dtype)
        if kernel is None:
            return None
        write_positions(k_cache, seq_ids, position_ids, key)
        write_positions(v_cache, seq_ids, position_ids, value)
        return kernel(q, k_cache, v_cache, seq_ids, mask, q.shape[-1] ** -0.5)

    @classmethod
    def graph_variant(cls) -> str:
        """Decoding traced with the kernel (empty: the default), or over gathered lines."""
        if not kernel_enabled():
            return f"decode attention over gathered lines ({SWITCH}=gather)"
        if decode_attention_op() is None:
            return "decode attention over gathered lines (the kernel could not be built)"
        return ""

    def reset(self) -> None:
        for buffer in self.buffers():
            buffer.zero_()

    def _layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"k_{layer}"), getattr(self, f"v_{layer}")


def usable_kernel(build: Callable[[], Any], q: torch.Tensor, cache_dtype: torch.dtype) -> Any:
    """The kernel ``build`` gives, where it serves these queries: switched on, on the CPU, up
    to KERNEL_MAX_QUERIES a row, in the cache's dtype, one the kernel takes; else None."""
    if not (
        kernel_enabled()
        and q.device.type == "cpu"
        and q.shape[2] <= KERNEL_MAX_QUERIES
        and q.dtype == cache_dtype
        and q.dtype in DTYPES
    ):
        return None
    return build()


def kernel_enabled() -> bool:
    """False when SWITCH says ``gather``; any other value but ``kernel`` is refused."""
    choice = os.environ.get(SWITCH, "kernel")
    if choice not in ("kernel", "gather"):
        raise NxdPlugError(f"{SWITCH}={choice!r}: expected 'kernel' (the default) or 'gather'")
    return choice == "kernel"
