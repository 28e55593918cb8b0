"""Compiled graphs run without holding Python's GIL (the inductor backend's graph runner):
another thread runs Python while a graph runs, as it cannot under torch's own loader."""

from __future__ import annotations

import tempfile
import threading
import time

import pytest
import torch
from torch import nn

from nxdplug.plugins.inductor_backend import graph_runner
from nxdplug.plugins.inductor_backend.backend import InductorBackend

MATMULS = 48  # of [512, 1024] by [1024, 1024]: ~50 GFLOP, a tenth of a second or more here


class LongGraph(nn.Module):
    """A graph function (``forward(weights, caches, *inputs)``) that runs long enough for
    another thread to wake up in the middle of it."""

    def forward(self, weights, caches, x):
        (w,) = weights
        for _ in range(MATMULS):
            x = torch.tanh(x @ w)
        return x


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    path = tmp_path_factory.mktemp("long-graph") / "g.pt2"
    weights = [torch.randn(1024, 1024) / 32]
    x = torch.randn(512, 1024)
    InductorBackend().compile_graph(
        LongGraph(), (weights, [], x), path, debug=False, compiler_args="prepack_weights=false"
    )
    return path, weights, x


def another_thread_ran_during_the_graph(graph, weights, x) -> bool:
    """A thread that sleeps 20 ms is started just before the graph: it wakes up (and stamps
    the time, which needs the GIL) in the first half of the run only if the run let go of the
    GIL; otherwise it gets the GIL back when the graph has returned."""
    woke: list[float] = []

    def sleeper() -> None:
        time.sleep(0.02)
        woke.append(time.perf_counter())

    thread = threading.Thread(target=sleeper)
    thread.start()
    start = time.perf_counter()
    out = graph(weights, [], x)
    end = time.perf_counter()
    thread.join()
    assert torch.allclose(out, LongGraph()(weights, [], x), atol=1e-4)
    assert end - start > 0.06, "the graph ran too briefly to tell"
    return woke[0] < start + (end - start) / 2


@pytest.fixture
def own_temporary_directory(tmp_path, monkeypatch):
    """A temporary directory of the test's own, for Python's tempfile and torch's C++ loader."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR again
    return tmp_path


def test_another_thread_runs_while_a_graph_runs(package, own_temporary_directory) -> None:
    """Also: the unpacked package is gone once the graph is loaded (the graph still runs)."""
    if not graph_runner.releases_gil():
        pytest.skip("the graph runner extension cannot be built here (warned above)")
    path, weights, x = package
    graph = InductorBackend().load_graph(path, weights_in_graph=False)
    assert isinstance(graph.loader, torch.ScriptObject)
    assert list(own_temporary_directory.iterdir()) == []
    assert another_thread_ran_during_the_graph(graph, weights, x)


def test_torchs_loader_holds_the_gil_for_the_whole_run(
    package, own_temporary_directory, monkeypatch
) -> None:
    """The fallback where the extension cannot be built, and the reasons for the extension:
    the GIL, and the unpacked package left while the graph lives (and after, at exit)."""
    monkeypatch.setattr(graph_runner, "releases_gil", lambda: False)
    path, weights, x = package
    graph = InductorBackend().load_graph(path, weights_in_graph=False)
    assert not isinstance(graph.loader, torch.ScriptObject)
    assert [p.name[:12] for p in own_temporary_directory.iterdir()] == ["aotinductor_"]
    assert not another_thread_ran_during_the_graph(graph, weights, x)
