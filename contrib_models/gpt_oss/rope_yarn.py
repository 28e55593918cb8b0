"""YaRN rotary embeddings (``rope_type: "yarn"``), which GPT-OSS checkpoints declare and the
core's rotary table does not implement.

YaRN keeps the fast-turning pairs of each head as they are (extrapolation), divides the
frequencies of the slow ones by ``factor`` (interpolation), with a linear ramp between the pair
that turns ``beta_fast`` times and the one that turns ``beta_slow`` times over the original
context; cos and sin are then scaled by an attention factor (0.1 ln(factor) + 1 by default).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from nxdplug.plugin_api import SUPPORTED_ROPE_TYPES, ConfigError, NotSupportedError, RotaryEmbedding

ROPE_TYPES = (*SUPPORTED_ROPE_TYPES, "yarn")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(params: Mapping[str, Any]) -> float:
    """What cos and sin are multiplied by: ``attention_factor`` when given, else from
    ``factor`` (and ``mscale`` / ``mscale_all_dim`` when both are given)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor, mscale, mscale_all_dim = (
        params["factor"],
        params.get("mscale"),
        params.get("mscale_all_dim"),
    )
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def correction_dim(rotations: float, head_dim: int, theta: float, length: int) -> float:
    """The (fractional) pair index whose frequency turns ``rotations`` times over ``length``."""
    return head_dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_inv_freq(head_dim: int, params: Mapping[str, Any]) -> torch.Tensor:
    theta, factor = params["rope_theta"], params["factor"]
    length = params["original_max_position_embeddings"]
    low = correction_dim(params.get("beta_fast") or 32, head_dim, theta, length)
    high = correction_dim(params.get("beta_slow") or 1, head_dim, theta, length)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    wavelengths = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolated, interpolated = 1.0 / wavelengths, 1.0 / (factor * wavelengths)
    return interpolated * ramp + extrapolated * (1 - ramp)


def yarn_problems(params: Mapping[str, Any]) -> list[str]:
    problems = []
    for key in ("factor", "original_max_position_embeddings"):
        if params.get(key) is None:
            problems.append(f"yarn rope needs rope_parameters[{key!r}], which is not set")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append("yarn rope with partial_rotary_factor != 1 is not implemented")
    return problems


class YarnRotaryEmbedding(nn.Module):
    """cos/sin tables of YaRN's frequencies, times its attention factor, in float32."""

    def __init__(self, head_dim: int, params: Mapping[str, Any]) -> None:
        super().__init__()
        problems = yarn_problems(params)
        if problems:
            raise ConfigError(problems)
        self.register_buffer("inv_freq", yarn_inv_freq(head_dim, params), persistent=False)
        self.attention_factor = yarn_attention_factor(params)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float()[..., None] * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def rotary_embedding(head_dim: int, params: Mapping[str, Any]) -> nn.Module:
    """The rotary table for ``params``: YaRN here, the other types from the core."""
    rope_type = params["rope_type"]
    if rope_type == "yarn":
        return YarnRotaryEmbedding(head_dim, params)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotSupportedError(
            f"rope_type {rope_type!r} is not implemented for GPT-OSS; supported: "
            f"{', '.join(ROPE_TYPES)}"
        )
    return RotaryEmbedding(head_dim, params)
