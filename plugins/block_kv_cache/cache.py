"""The block KV cache: per layer, K and V as ``pa_num_blocks`` blocks of ``pa_block_size``
positions ([blocks + 1, kv_heads, block_size, head_dim]; the last is the null block).

Each row reaches its positions through its block table (the ``block_tables`` step input,
[batch, blocks_per_line]): position p of a row lies at offset ``p % block_size`` of block
``table[p // block_size]``. A table entry of -1 stands for the row's own line of blocks
(``seq_id x blocks_per_line + column``), which is how ``generate()`` uses the layout without
an engine lending blocks. A token whose position the step's cache mask leaves out (a padding
token) writes into the null block, so padding never reaches a block a request owns.
"""

from __future__ import annotations

from typing import Any

import torch

from nxdplug.plugin_api import CacheLayout, KVCacheManager, current_step
from nxdplug.plugins.block_kv_cache.settings import BLOCK_TABLES, BlockSettings
from nxdplug.plugins.static_kv_cache.cache import kernel_enabled, usable_kernel
from nxdplug.plugins.static_kv_cache.kernel import paged_decode_attention_op


class BlockKVCache(KVCacheManager):
    def __init__(self, layout: CacheLayout) -> None:
        super().__init__(layout)
        self.settings = BlockSettings.of(layout.neuron_config)
        size = self.settings.block_size
        shape = (self.settings.num_blocks + 1, layout.num_kv_heads, size, layout.head_dim)
        for layer in range(layout.num_layers):
            self.register_buffer(f"k_{layer}", torch.zeros(shape, dtype=layout.dtype), False)
            self.register_buffer(f"v_{layer}", torch.zeros(shape, dtype=layout.dtype), False)
        # Registers the kernel now: a compiled graph that calls it can only be loaded once it is.
        paged_decode_attention_op()
        self._last_step: tuple[Any, torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    def update_and_read(
        self,
        layer: int,
        key: torch.Tensor,
        value: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor,
        length: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._store(layer, key, value, position_ids, seq_ids)
        k_cache, v_cache = self._layer(layer)
        keys = self._read(k_cache, table, length, key.dtype)
        return keys, self._read(v_cache, table, length, value.dtype)

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
        """Up to KERNEL_MAX_QUERIES queries a row on the CPU, in the cache's float32 or
        bfloat16: the static cache's decode kernel, reading each row's blocks where they are
        (``paged_decode_attention``) instead of a copy of them."""
        k_cache, v_cache = self._layer(layer)
        kernel = usable_kernel(paged_decode_attention_op, q, k_cache.dtype)
        if kernel is None:
            return None
        table = self._store(layer, key, value, position_ids, seq_ids)
        return kernel(q, k_cache, v_cache, table, mask, q.shape[-1] ** -0.5)

    @classmethod
    def graph_variant(cls) -> str:
        """Decoding traced with the paged kernel (empty: the default), or over gathered
        blocks."""
        if not kernel_enabled():
            return "decode attention over gathered blocks (NXDPLUG_DECODE_ATTENTION=gather)"
        if paged_decode_attention_op() is None:
            return "decode attention over gathered blocks (the kernel could not be built)"
        return ""

    def _store(
        self,
        layer: int,
        key: torch.Tensor,
        value: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Write the step's keys and values where the rows' tables say; the tables."""
        table, blocks, offsets = self._addresses(position_ids, seq_ids)
        k_cache, v_cache = self._layer(layer)
        k_cache[blocks, :, offsets] = key.transpose(1, 2).to(k_cache.dtype)
        v_cache[blocks, :, offsets] = value.transpose(1, 2).to(v_cache.dtype)
        return table

    def _addresses(
        self, position_ids: torch.Tensor, seq_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' tables and the block and offset of each new token, computed once a step
        (every layer of a step shares them; a graph then holds them once)."""
        step = current_step()
        last = self._last_step
        if last is not None and last[0] is step and last[1] is position_ids:
            return last[2]
        table = self.tables(step[BLOCK_TABLES], seq_ids)
        addresses = (table, *self.slots(table, position_ids, step.attention_mask))
        self._last_step = (step, position_ids, addresses)
        return addresses

    def tables(self, block_tables: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
        """The rows' block tables, -1 entries resolved to the row's own line of blocks."""
        per_line = self.settings.blocks_per_line
        columns = torch.arange(per_line, device=block_tables.device)
        own = seq_ids[:, None] * per_line + columns
        return torch.where(block_tables < 0, own, block_tables)

    def slots(
        self, table: torch.Tensor, position_ids: torch.Tensor, cache_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block and offset each token's keys and values go to ([batch, seq] each): its
        position's, or the null block's for a token the cache mask leaves out."""
        size, width = self.settings.block_size, cache_mask.shape[-1]
        inside = position_ids.clamp(0, width - 1)
        kept = (position_ids < width) & cache_mask.gather(1, inside).bool()
        column = (inside // size).clamp(max=table.shape[1] - 1)
        blocks = torch.where(kept, table.gather(1, column), self.settings.null_block)
        return blocks, position_ids % size

    def _read(
        self, cache: torch.Tensor, table: torch.Tensor, length: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """The rows' first ``length`` positions, [batch, kv_heads, length, head_dim]."""
        size = self.settings.block_size
        count = -(-length // size)
        gathered = cache[table[:, :count]]  # [batch, count, kv_heads, size, dim]
        batch, _, heads, _, dim = gathered.shape
        lines = gathered.transpose(1, 2).reshape(batch, heads, count * size, dim)
        return lines[:, :, :length].to(dtype)

    def position_buffers(self) -> list[torch.Tensor]:
        return []

    def reset(self) -> None:
        for buffer in self.buffers():
            buffer.zero_()

    def _layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"k_{layer}"), getattr(self, f"v_{layer}")
