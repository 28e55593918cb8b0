"""Lay the attention projections of a checkpoint out as the model's heads are: K/V heads
replicated (or converted to MHA), query heads padded to a multiple of tp_degree."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from nxdplug.plugin_api import HeadLayout, head_dim_of, head_layout

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

# ``weight_scale``: the per-channel scales of a quantized checkpoint follow their rows.
KV_PROJECTION = re.compile(r"(^|\.)self_attn\.[kv]_proj\.(weight|bias|weight_scale)$")
Q_PROJECTION = re.compile(r"(^|\.)self_attn\.q_proj\.(weight|bias|weight_scale)$")
O_PROJECTION = re.compile(r"(^|\.)self_attn\.o_proj\.weight$")
# One value per query head (GPT-OSS's learned attention sinks).
PER_HEAD = re.compile(r"(^|\.)self_attn\.sinks$")


def _is_shared_scale(key: str, tensor: torch.Tensor) -> bool:
    # A per-tensor scale (one element) holds for every copy of the heads as it is.
    return key.endswith("_scale") and tensor.numel() == 1


def _laid_out(key: str, tensor: torch.Tensor, layout: HeadLayout, head_dim: int) -> torch.Tensor:
    if _is_shared_scale(key, tensor):
        return tensor
    if KV_PROJECTION.search(key):
        return layout.kv_heads(tensor, head_dim)
    if not layout.is_padded:
        return tensor
    if Q_PROJECTION.search(key):
        return layout.query_heads(tensor, head_dim)
    if O_PROJECTION.search(key):
        return layout.query_heads(tensor, head_dim, dim=1)
    if PER_HEAD.search(key):
        return layout.query_heads(tensor, 1)
    return tensor


def lay_out_attention_heads(
    state_dict: dict[str, torch.Tensor], config: InferenceConfig
) -> dict[str, torch.Tensor]:
    """k_proj/v_proj weights, biases and quantization scales with num_key_value_heads grown to
    the layout's count; with padded query heads, q_proj rows, o_proj columns and per-head
    values padded with zero heads."""
    layout = head_layout(config)
    if layout.head_counts == (layout.num_attention_heads, layout.num_key_value_heads):
        return state_dict
    head_dim = head_dim_of(config)
    return {key: _laid_out(key, tensor, layout, head_dim) for key, tensor in state_dict.items()}
