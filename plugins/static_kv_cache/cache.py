"""The static KV cache: per layer, K and V buffers of [max_batch, kv_heads, seq_len, head_dim]."""

from __future__ import annotations

import torch

from nxdplug.modules.kv_cache import CacheLayout, KVCacheManager


class StaticKVCache(KVCacheManager):
    def __init__(self, layout: CacheLayout) -> None:
        super().__init__(layout)
        shape = (layout.max_batch_size, layout.num_kv_heads, layout.max_length, layout.head_dim)
        for layer in range(layout.num_layers):
            self.register_buffer(f"k_{layer}", torch.zeros(shape, dtype=layout.dtype), False)
            self.register_buffer(f"v_{layer}", torch.zeros(shape, dtype=layout.dtype), False)

    def update_and_read(
        self,
        layer: int,
        key: torch.Tensor,
        value: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor,
        length: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache, v_cache = getattr(self, f"k_{layer}"), getattr(self, f"v_{layer}")
        rows = seq_ids[:, None]
        # cache[row, :, position, :] = new[b, :, t, :] for every (b, t)
        k_cache[rows, :, position_ids] = key.transpose(1, 2).to(k_cache.dtype)
        v_cache[rows, :, position_ids] = value.transpose(1, 2).to(v_cache.dtype)
        keys = k_cache[seq_ids, :, :length].to(key.dtype)
        values = v_cache[seq_ids, :, :length].to(value.dtype)
        return keys, values

    def reset(self) -> None:
        for buffer in self.buffers():
            buffer.zero_()
