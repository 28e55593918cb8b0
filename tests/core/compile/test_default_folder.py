"""The cache folder ``nxdplug serve`` compiles into without --compiled-model-path: one per
config hash, and per checkpoint too for graphs that hold their weights."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from nxdplug.compile import default_folder


def app_with_weights_in(folder: Path) -> SimpleNamespace:
    return SimpleNamespace(
        model_path=folder, config=None, weights_source=lambda path, config: Path(path)
    )


@pytest.mark.parametrize("holds_weights", [False, True])
def test_a_changed_checkpoint_moves_only_graphs_holding_weights(
    tmp_path, monkeypatch, holds_weights
) -> None:
    monkeypatch.setenv("NXDPLUG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default_folder, "graphs_digest", lambda app: ("ab" * 32, holds_weights))
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(b"first")
    app = app_with_weights_in(checkpoint)
    before = default_folder.default_compiled_folder(app)
    assert before.parent == tmp_path / "cache" / "compiled"
    assert (before.name == "ab" * 8) is not holds_weights
    assert default_folder.default_compiled_folder(app) == before  # the same start after start
    weights.write_bytes(b"second")  # written again in place: another size
    os.utime(weights, ns=(1, 1))
    after = default_folder.default_compiled_folder(app)
    assert (after != before) is holds_weights


def test_without_the_variable_the_cache_is_under_xdg_cache_home(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("NXDPLUG_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_folder.cache_root() == tmp_path / "nxdplug"
