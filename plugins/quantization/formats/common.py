"""What the readers of other tools' quantized checkpoints share: which projections the
checkpoint left in full precision, and dequantizing what cannot run as stored."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable

import torch

from nxdplug.plugins.quantization.targets import QUANTIZED_PROJECTIONS

log = logging.getLogger("nxdplug.quantization")

MODEL_PREFIX = "model."
HEAD = "lm_head"


def module_name(module: str) -> str:
    """A checkpoint's module as ``modules_to_not_convert`` names it (without the checkpoint's
    ``model.`` prefix)."""
    return module.removeprefix(MODEL_PREFIX)


def full_precision_projections(tensor_names: Collection[str], quantized_suffix: str) -> list[str]:
    """The projections the quantization plugin would quantize that the checkpoint holds in full
    precision (a ``.weight`` and no ``quantized_suffix`` tensor), and the LM head unless the
    checkpoint quantized it: the ``modules_to_not_convert`` that loads it as stored."""
    quantized = {
        module_name(n.rpartition(".")[0]) for n in tensor_names if n.endswith(quantized_suffix)
    }
    dense = {module_name(n.rpartition(".")[0]) for n in tensor_names if n.endswith(".weight")}
    left = {m for m in dense - quantized if m.rpartition(".")[2] in QUANTIZED_PROJECTIONS}
    if HEAD not in quantized:
        left.add(HEAD)
    return sorted(left)


def module_parts(
    state_dict: dict[str, torch.Tensor], leaves: Collection[str]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """``state_dict`` split into the tensors whose last name is one of ``leaves``, by module
    (``{module: {leaf: tensor}}``), and the rest."""
    rest: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        module, _, leaf = key.rpartition(".")
        if leaf in leaves:
            parts.setdefault(module, {})[leaf] = tensor
        else:
            rest[key] = tensor
    return rest, parts


def groups_in_order(g_idx: torch.Tensor | None, group: int) -> bool:
    """Whether each input feature's group (``g_idx``, None: not given) is the one of consecutive
    groups of ``group`` features, as the int4 kernel takes them."""
    if g_idx is None:
        return True
    return torch.equal(g_idx.long(), torch.arange(g_idx.numel()) // group)


def expand_scales(
    per_group: torch.Tensor,
    shape: tuple[int, int],
    group: int | None = None,
    block: tuple[int, int] | None = None,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scales (or zero points) stored per tensor, per output row, per ``group`` input features
    (the group of each input feature given by ``g_idx`` when the tool reordered them) or per
    ``block`` of rows x features, as one value per weight [out, in]."""
    rows, features = shape
    if per_group.numel() == 1:
        return per_group.reshape(1, 1).expand(rows, features)
    values = per_group.reshape(per_group.shape[0], -1)
    if block is not None:
        values = values.repeat_interleave(block[0], dim=0)[:rows]
        return values.repeat_interleave(block[1], dim=1)[:, :features]
    if values.shape[1] == 1:
        return values.expand(rows, features)
    if g_idx is not None:
        return values[:, g_idx.long()]
    return values.repeat_interleave(group or -(-features // values.shape[1]), dim=1)[:, :features]


def dequantize(
    quantized: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None = None,
    **grouping: object,
) -> torch.Tensor:
    """``(Q - zero_point) * scale`` in float32, scales and zero points expanded by
    :func:`expand_scales` (``grouping``: its ``group``, ``block`` and ``g_idx``)."""
    shape = tuple(quantized.shape)
    values = quantized.float()
    if zero_point is not None:
        values = values - expand_scales(zero_point.float(), shape, **grouping)
    return values * expand_scales(scale.float(), shape, **grouping)


def log_dequantized(tool: str, modules: Iterable[str], why: str) -> None:
    modules = list(modules)
    if modules:
        shown = ", ".join(modules[:3]) + (
            f" and {len(modules) - 3} more" if len(modules) > 3 else ""
        )
        log.info("%s checkpoint: %s dequantized to full precision at load (%s)", tool, shown, why)
