"""Concatenate each attention layer's Q, K and V projections into ``qkv_proj``."""

from __future__ import annotations

import re
from typing import Any

import torch

Q_PROJECTION = re.compile(r"^(?P<prefix>.*self_attn\.)q_proj\.(?P<kind>weight|bias)$")


def fuse_qkv_projections(
    state_dict: dict[str, torch.Tensor], config: Any
) -> dict[str, torch.Tensor]:
    """q_proj, k_proj, v_proj (weight and bias) -> qkv_proj, stacked along the output dim."""
    fused = dict(state_dict)
    for key in list(state_dict):
        match = Q_PROJECTION.match(key)
        if match is None:
            continue
        prefix, kind = match["prefix"], match["kind"]
        parts = [fused.pop(f"{prefix}{name}_proj.{kind}") for name in ("q", "k", "v")]
        fused[f"{prefix}qkv_proj.{kind}"] = torch.cat(parts, dim=0)
    return fused
