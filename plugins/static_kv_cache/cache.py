"""The static KV cache: per layer, K and V buffers of [max_batch, kv_heads, seq_len, head_dim]."""

from __future__ import annotations

import torch

from nxdplug.modules.kv_cache import CacheLayout, KVCacheManager, read_prefix, write_positions


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
        write_positions(k_cache, seq_ids, position_ids, key)
        write_positions(v_cache, seq_ids, position_ids, value)
        keys = read_prefix(k_cache, seq_ids, length).to(key.dtype)
        values = read_prefix(v_cache, seq_ids, length).to(value.dtype)
        return keys, values

    def reset(self) -> None:
        for buffer in self.buffers():
            buffer.zero_()
