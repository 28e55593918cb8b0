"""Checkpoints made from another's weights, for tests that need two related models."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch


def derived_checkpoint(
    source: str | Path,
    output: str | Path,
    *,
    num_layers: int | None = None,
    edit: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    """A checkpoint made from ``source``'s weights: its first ``num_layers`` layers (with its
    embeddings, final norm and LM head), and/or tensors changed in place by ``edit``.

    Speculation tests use it to build drafts that agree with a target often (its first layers,
    or the target itself) or never (an LM head edited to always pick one token).
    """
    from safetensors.torch import load_file, save_file

    source, output = Path(source), Path(output)
    output.mkdir(parents=True)
    for item in source.iterdir():
        if item.name not in ("config.json", "model.safetensors"):
            shutil.copy(item, output / item.name)
    config = json.loads((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
        kept = {f"model.layers.{i}." for i in range(num_layers)}
        tensors = {
            name: tensor
            for name, tensor in tensors.items()
            if not name.startswith("model.layers.") or any(name.startswith(k) for k in kept)
        }
    if edit is not None:
        edit(tensors)
    (output / "config.json").write_text(json.dumps(config, indent=2))
    save_file({name: t.contiguous() for name, t in tensors.items()}, output / "model.safetensors")
    return output
