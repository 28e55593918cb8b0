"""Medusa-1 heads: the modules, and their weights read from a file beside the checkpoint.

Medusa heads are trained apart from the target and shipped apart from it, so the heads are not
in the target's checkpoint: the converter adds them to the state dict from the checkpoint folder
(``config._name_or_path``), or from ``medusa_heads_path`` when set (a folder of its own, as
vLLM's medusa ``model``), in whichever of the formats in use it finds:

- ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt`` (FasterDecoding/Medusa, TGI,
  TensorRT-LLM): keys ``{i}.{j}.linear.weight/bias`` (ResBlock j of head i) and
  ``{i}.{L}.weight`` (its vocabulary projection, L = ``medusa_num_layers``);
- ``medusa_heads.pt`` (NxD Inference): the same keys prefixed ``medusa_head_{i}.``.

Heads already in the checkpoint under either prefix are used as they are, unless
``medusa_heads_path`` names the heads to use.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nxdplug.plugin_api import CheckpointError, load_tensor_file
from nxdplug.plugins.medusa.hooks import DEFAULT_LAYERS, HEADS_PATH_SETTING, LAYERS_SETTING

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

HEADS_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "medusa_heads.pt")
HEADS_ATTRIBUTE = "medusa_head"

_IN_CHECKPOINT = re.compile(r"^medusa_head[._](\d+)\.(\d+\..+)$")
_IN_HEADS_FILE = re.compile(r"^(?:medusa_head[._])?(\d+)\.(\d+\..+)$")
_RESBLOCK_WEIGHT = re.compile(r"^(\d+)\.linear\.weight$")


class ResBlock(nn.Module):
    """``x + SiLU(linear(x))``, as in Medusa."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


def medusa_heads(
    num_heads: int, num_layers: int, hidden_size: int, vocab_size: int
) -> nn.ModuleList:
    """Head i: ``num_layers`` ResBlocks then a bias-free projection to the vocabulary."""
    return nn.ModuleList(
        nn.Sequential(
            *(ResBlock(hidden_size) for _ in range(num_layers)),
            nn.Linear(hidden_size, vocab_size, bias=False),
        )
        for _ in range(num_heads)
    )


def num_layers(config: InferenceConfig) -> int:
    """ResBlocks per head (``medusa_num_layers``, 1 as in Medusa-1 releases and NxD Inference)."""
    return getattr(config.neuron_config, LAYERS_SETTING, DEFAULT_LAYERS)


def _split(state_dict: dict[str, torch.Tensor], pattern: re.Pattern) -> tuple[dict, dict]:
    """(heads: {(head, rest): tensor}, everything else)."""
    heads, others = {}, {}
    for name, tensor in state_dict.items():
        found = pattern.match(name)
        if found:
            heads[int(found.group(1)), found.group(2)] = tensor
        else:
            others[name] = tensor
    return heads, others


def _read_heads_file(folder: Path) -> tuple[dict[tuple[int, str], torch.Tensor], Path]:
    for name in HEADS_FILES:
        path = folder / name
        if path.is_file():
            heads, others = _split(load_tensor_file(path), _IN_HEADS_FILE)
            if others:
                raise CheckpointError(
                    f"{path} holds tensors that are not Medusa head weights: "
                    f"{', '.join(sorted(others)[:5])}"
                )
            return heads, path
    raise CheckpointError(
        f"is_medusa=True but no Medusa heads were found in {folder}: looked for "
        f"{', '.join(HEADS_FILES)}. Put the trained heads file there (next to "
        f"the target checkpoint), or name its folder with {HEADS_PATH_SETTING}."
    )


def add_medusa_heads(state_dict: dict[str, Any], config: InferenceConfig) -> dict[str, Any]:
    """The state dict with the first ``num_medusa_heads`` heads as ``medusa_head.{i}.*``, cast
    to ``torch_dtype`` (the heads run in the model's dtype; released heads are fp16)."""
    neuron_config = config.neuron_config
    heads, state_dict = _split(state_dict, _IN_CHECKPOINT)
    source = "the checkpoint"
    heads_path = getattr(neuron_config, HEADS_PATH_SETTING, None)
    if heads_path is not None:
        heads, path = _read_heads_file(Path(heads_path))
        source = str(path)
    elif not heads:
        folder = getattr(config, "_name_or_path", None)
        if not folder:
            raise CheckpointError(
                "is_medusa=True but the config does not say which folder holds the checkpoint "
                "(config._name_or_path), so the Medusa heads file cannot be found; load the "
                "config with load_pretrained_config(checkpoint_folder)"
            )
        heads, path = _read_heads_file(Path(folder))
        source = str(path)
    wanted = neuron_config.num_medusa_heads
    available = {head for head, _ in heads}
    missing = [head for head in range(wanted) if head not in available]
    if missing:
        raise CheckpointError(
            f"num_medusa_heads={wanted} but {source} has no weights for head(s) {missing} "
            f"(it holds {len(available)}); lower num_medusa_heads"
        )
    layers = {int(m.group(1)) for (_, rest) in heads if (m := _RESBLOCK_WEIGHT.match(rest))}
    if len(layers) != num_layers(config):
        raise CheckpointError(
            f"the Medusa heads in {source} have {len(layers)} ResBlock(s) each, but the model "
            f"is built with {num_layers(config)}; set {LAYERS_SETTING}={len(layers)}"
        )
    dtype = neuron_config.torch_dtype
    for (head, rest), tensor in heads.items():
        if head < wanted:
            state_dict[f"{HEADS_ATTRIBUTE}.{head}.{rest}"] = tensor.to(dtype)
    return state_dict
