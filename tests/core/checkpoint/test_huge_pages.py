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


def advised_for_huge_pages(address: int) -> bool:
    """Whether the mapping holding ``address`` is advised MADV_HUGEPAGE ("hg" in its VmFlags);
    whether the kernel found free 2 MiB pages for it depends on the machine's memory."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and ":" not in first:
            start, end = (int(bound, 16) for bound in first.split("-"))
            mapping = start <= address < end
        elif first == "VmFlags:" and mapping:
            return "hg" in line.split()[1:]
    return False


@thp_on_request
def test_tensors_move_into_huge_pages_with_their_values() -> None:
    before = tensors()
    moved = list(before)
    assert huge_pages.move_to_huge_pages(moved) > 0
    for original, copy in zip(before, moved, strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape
        assert torch.equal(copy, original)
    # contiguous ones are views of one arena starting on a huge page; the others stay
    assert moved[0].untyped_storage().data_ptr() == moved[1].untyped_storage().data_ptr()
    assert moved[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert moved[3] is before[3] and moved[4] is before[4]
    assert advised_for_huge_pages(moved[0].data_ptr())
    assert not advised_for_huge_pages(before[0].data_ptr())


def test_nothing_moves_when_switched_off(monkeypatch) -> None:
    monkeypatch.setenv(huge_pages.SWITCH, "0")
    huge_pages.huge_pages_on_request.cache_clear()
    try:
        moved = tensors()
        originals = list(moved)
        assert huge_pages.move_to_huge_pages(moved) == 0
        assert all(a is b for a, b in zip(moved, originals, strict=True))
        assert huge_pages.huge_page_buffer(1 << 20) is None
    finally:
        monkeypatch.undo()
        huge_pages.huge_pages_on_request.cache_clear()
