"""A cache line written by several rows of one step (continuous batching's padding rows repeat
a running row's line) receives the first such row's keys and values, bit for bit."""

from __future__ import annotations

import torch

from nxdplug.modules.kv_cache import CacheLayout, CacheSlot, first_row_of_each_line
from nxdplug.plugins.static_kv_cache.cache import StaticKVCache


def test_each_row_finds_the_first_row_of_its_line() -> None:
    seq_ids = torch.tensor([2, 0, 2, 2, 1])
    assert first_row_of_each_line(seq_ids).tolist() == [0, 1, 0, 0, 4]


def test_padding_rows_write_the_running_rows_values() -> None:
    layout = CacheLayout(1, 3, 1, 4, 2, torch.float32)
    cache = StaticKVCache(layout)
    seq_ids = torch.tensor([2, 0, 2, 2])  # rows 2 and 3 pad the batch on row 0's line
    positions = torch.tensor([[1], [3], [1], [1]])
    key = torch.arange(4.0)[:, None, None, None].expand(4, 1, 1, 2)  # each row its own value
    slot = CacheSlot(cache, 0, positions, seq_ids, 4, first_row_of_each_line(seq_ids))
    keys, values = slot.store_and_fetch(key, key + 10)
    assert values[2, 0, 1].tolist() == [10.0, 10.0]
    assert cache.k_0[2, 0, 1].tolist() == [0.0, 0.0]  # row 0's, whatever order rows wrote in
    assert cache.v_0[0, 0, 3].tolist() == [11.0, 11.0]
    assert keys[3, 0, 1].tolist() == [0.0, 0.0]
