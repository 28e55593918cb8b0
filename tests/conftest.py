"""Shared fixtures: offline HF, fake installed distributions, plugin isolation."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The graphs' kernels keep -O3; only AOTInductor's host wrapper (the calls from one kernel to
# the next) compiles at -O0 here, ~10% off each compiled test. It computes the same; nxdplug's
# own default stays torch's -O1 (docs/serving.md says what -O0 costs at run time).
os.environ.setdefault("AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL", "O0")
# Under pytest-xdist (`make test`: a worker per core) each worker, and the servers and ranks it
# starts, computes on one thread: two workers with a thread pool each the size of the machine
# spin against each other (4 files: 124 s with torch's default, 106 s with one thread). Set
# before torch is imported, which reads it once.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def fake_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Path]]:
    """Install a fake distribution (a ``*.dist-info`` folder and a module) on ``sys.path``.

    The module is dropped from ``sys.modules`` before and after, so each test imports its own.
    """
    modules: list[str] = []

    def install(
        name: str, version: str, module_source: str, entry_point: str | None = None
    ) -> Path:
        root = tmp_path / f"site-{name}"
        root.mkdir()
        module = f"{name}_plugin"
        modules.append(module)
        sys.modules.pop(module, None)
        (root / f"{module}.py").write_text(textwrap.dedent(module_source))
        info = root / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[nxdplug]\n{entry_point or name} = {module}\n")
        monkeypatch.syspath_prepend(str(root))
        return root

    yield install
    for module in modules:
        sys.modules.pop(module, None)


@pytest.fixture
def plugin_manager() -> Iterator:
    """A fresh process-wide plugin manager with every installed plugin, for this test only."""
    from nxdplug.testing import fresh_plugin_manager

    with fresh_plugin_manager() as manager:
        yield manager


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Build (once per session and settings) a tiny random HF checkpoint of an architecture."""
    from nxdplug.testing.tiny_models import make_tiny_checkpoint

    built: dict[tuple, Path] = {}

    def build(architecture: str = "llama", seed: int = 0, **overrides) -> Path:
        key = (architecture, seed, repr(sorted(overrides.items())))
        if key not in built:
            folder = tmp_path_factory.mktemp(architecture) / "checkpoint"
            built[key] = make_tiny_checkpoint(architecture, folder, seed=seed, overrides=overrides)
        return built[key]

    return build
