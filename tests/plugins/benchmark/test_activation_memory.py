"""The activation-memory tracker on computations of known sizes, and the two-rank measurement
of sequence parallelism against tensor parallelism alone."""

from __future__ import annotations

import pytest
import torch

from nxdplug.plugins.benchmark.activation_memory import (
    ActivationMemoryTracker,
    Measurement,
    check,
    main,
    rank_peaks,
)

FLOATS = 1000  # 4000 bytes in float32


def test_peak_is_the_most_bytes_alive_at_once() -> None:
    with ActivationMemoryTracker() as tracker:
        a = torch.empty(FLOATS)
        b = torch.empty(FLOATS // 2)
        del a
        c = torch.empty(FLOATS // 4)
    assert (tracker.peak_bytes, tracker.live_bytes) == (6000, 3000)
    del b, c
    assert tracker.live_bytes == 0


def test_temporaries_count_while_alive() -> None:
    x = torch.ones(FLOATS)
    with ActivationMemoryTracker() as tracker:
        y = x * 2 + 1  # the product is freed once the sum exists
    assert (tracker.peak_bytes, tracker.live_bytes) == (8000, 4000)
    assert torch.equal(y, torch.full((FLOATS,), 3.0))


def test_views_count_once_until_their_storage_is_freed() -> None:
    with ActivationMemoryTracker() as tracker:
        a = torch.ones(FLOATS)
        view = a[10:].view(-1, 10)
        del a
        assert tracker.live_bytes == 4000  # the view keeps the storage
        del view
    assert (tracker.peak_bytes, tracker.live_bytes) == (4000, 0)


def test_tensors_that_existed_before_are_not_counted() -> None:
    cache = torch.zeros(FLOATS)
    with ActivationMemoryTracker() as tracker:
        cache.add_(1)
        cache[:10] = 3
        cache.narrow(0, 0, 100).mul_(2)
    assert (tracker.peak_bytes, tracker.live_bytes) == (0, 0)


def test_bad_settings_are_listed_before_anything_runs(tmp_path) -> None:
    problems = check(Measurement(str(tmp_path), prompt_length=7, tp_degree=2, torch_dtype="bf16"))
    assert len(problems) == 2
    assert "no config.json" in problems[0]
    assert "multiple of --tp-degree" in problems[1]
    assert "--tp-degree must be 2" in check(Measurement(str(tmp_path), 8, 1, "float32"))[1]


def test_a_user_mistake_is_one_line_without_traceback(tmp_path, capsys) -> None:
    assert main(["--model-path", str(tmp_path), "--prompt-length", "7"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("activation_memory: error: --model-path")
    assert "Traceback" not in error


@pytest.mark.slow
def test_sequence_parallelism_lowers_each_ranks_peak(tiny_checkpoint) -> None:
    """Hidden 256 over 64 tokens: the residual stream, which SP splits, outweighs the mask."""
    checkpoint = tiny_checkpoint("llama", hidden_size=256)
    ranks = rank_peaks(Measurement(str(checkpoint), 64, 2, "float32"))
    assert len(ranks) == 2
    for peaks in ranks:
        assert 0 < peaks["tp+sp"] < peaks["tp"]
