"""Rotary position embeddings (RoPE), with the scaling variants HF configs declare."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nxdplug.errors import NotSupportedError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from nxdplug.config import InferenceConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """1 / theta^(2i/d) for i in [0, d/2): the frequency of each rotated pair."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: slow frequencies divided by ``factor``, fast ones kept, a smooth ramp
    between them."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    original_length = scaling["original_max_position_embeddings"]
    low_freq_wavelen = original_length / low_freq_factor
    high_freq_wavelen = original_length / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_length / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_parameters(config: PretrainedConfig | InferenceConfig) -> dict[str, Any]:
    """The rope settings of an HF config, whichever of its spellings it uses.

    transformers 5 writes ``rope_parameters`` (theta inside); transformers 4 writes
    ``rope_theta`` and ``rope_scaling`` (with ``type`` or ``rope_type``).
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    params = {**scaling, **params}
    if "rope_type" not in params:
        params["rope_type"] = params.pop("type", "default")
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    return params


def rope_inv_freq(head_dim: int, params: Mapping[str, Any]) -> torch.Tensor:
    inv_freq = default_inv_freq(head_dim, params["rope_theta"])
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return llama3_inv_freq(inv_freq, params)
    raise NotSupportedError(
        f"rope_type {rope_type!r} is not implemented; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the given positions, computed in float32."""

    def __init__(self, head_dim: int, params: Mapping[str, Any]) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, params), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float()[..., None] * self.inv_freq  # [batch, seq, head_dim/2]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k ([batch, heads, seq, head_dim]) by their positions' angles.

    A table narrower than ``head_dim`` rotates only the first dims of each head and leaves the
    rest as they are (partial rotary, as GPT-NeoX's ``rotary_pct``).
    """
    cos = cos.unsqueeze(1).to(q.dtype)
    sin = sin.unsqueeze(1).to(q.dtype)
    dims = cos.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        if dims == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        turned, kept = x[..., :dims], x[..., dims:]
        return torch.cat((turned * cos + rotate_half(turned) * sin, kept), dim=-1)

    return rotate(q), rotate(k)
