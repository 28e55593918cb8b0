"""Concatenate each attention layer's Q, K and V projections into ``qkv_proj``."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

Q_PROJECTION = re.compile(r"^(?P<prefix>.*self_attn\.)q_proj\.(?P<kind>weight|bias|weight_scale)$")


def fuse_qkv_projections(
    state_dict: dict[str, torch.Tensor], config: InferenceConfig
) -> dict[str, torch.Tensor]:
    """q_proj, k_proj, v_proj (weight and bias) -> qkv_proj, stacked along the output dim.

    A quantized checkpoint's ``weight_scale`` follows its weight's rows. Per-tensor scales
    differ between q, k and v, so they become one scale per row of the fused projection;
    group scales ([rows, groups]) are stacked as they are.
    """
    fused = dict(state_dict)
    for key in list(state_dict):
        match = Q_PROJECTION.match(key)
        if match is None:
            continue
        prefix, kind = match["prefix"], match["kind"]
        names = [f"{prefix}{name}_proj" for name in ("q", "k", "v")]
        parts = [fused.pop(f"{name}.{kind}") for name in names]
        if kind == "weight_scale" and parts[0].dim() < 2:
            rows = [state_dict[f"{name}.weight"].shape[0] for name in names]
            parts = [s.reshape(-1).expand(n) for s, n in zip(parts, rows, strict=True)]
        fused[f"{prefix}qkv_proj.{kind}"] = torch.cat(parts, dim=0)
    return fused
