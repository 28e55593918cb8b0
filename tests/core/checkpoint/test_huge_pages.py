"""Weights copied into huge pages: same values, dtypes and shapes; what cannot move stays."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nxdplug.checkpoint import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
thp_on_request = pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(),
    reason="this system gives no transparent huge pages on request",
)


def tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(700, 513, generator=generator).bfloat16(),
        torch.randint(-128, 128, (33, 7), generator=generator, dtype=torch.int8),
        torch.randn(5, generator=generator),
        torch.empty(0),
        torch.randn(8, 6, generator=generator).t(),  # not contiguous
    ]


def anon_huge_kb() -> int:
    rollup = Path("/proc/self/smaps_rollup").read_text()
    return int(rollup.split("AnonHugePages:")[1].split()[0])


@thp_on_request
def test_tensors_move_into_huge_pages_with_their_values() -> None:
    before = tensors()
    moved = list(before)
    huge_before = anon_huge_kb()
    assert huge_pages.move_to_huge_pages(moved) > 0
    for original, copy in zip(before, moved, strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape
        assert torch.equal(copy, original)
    # contiguous ones are views of one arena starting on a huge page; the others stay
    assert moved[0].untyped_storage().data_ptr() == moved[1].untyped_storage().data_ptr()
    assert moved[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert moved[3] is before[3] and moved[4] is before[4]
    assert anon_huge_kb() > huge_before


def test_nothing_moves_when_switched_off(monkeypatch) -> None:
    monkeypatch.setenv(huge_pages.SWITCH, "0")
    huge_pages._madvise.cache_clear()
    try:
        moved = tensors()
        originals = list(moved)
        assert huge_pages.move_to_huge_pages(moved) == 0
        assert all(a is b for a, b in zip(moved, originals, strict=True))
        assert huge_pages.huge_page_buffer(1 << 20) is None
    finally:
        monkeypatch.undo()
        huge_pages._madvise.cache_clear()
