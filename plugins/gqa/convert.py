"""Replicate K/V projection heads so the checkpoint matches the attention's head layout."""

from __future__ import annotations

import re
from typing import Any

import torch

from nxdplug.modules.attention import attention_head_counts, head_dim_of
from nxdplug.modules.gqa import replicate_kv_heads

# ``weight_scale``: the per-channel scales of a quantized checkpoint follow their rows.
KV_PROJECTION = re.compile(r"(^|\.)self_attn\.[kv]_proj\.(weight|bias|weight_scale)$")


def _is_replicated(key: str, tensor: torch.Tensor) -> bool:
    # A per-tensor scale (one element) holds for every copy of the heads as it is.
    is_shared_scale = key.endswith("_scale") and tensor.numel() == 1
    return KV_PROJECTION.search(key) is not None and not is_shared_scale


def replicate_kv_projections(
    state_dict: dict[str, torch.Tensor], config: Any
) -> dict[str, torch.Tensor]:
    """k_proj/v_proj weights, biases and quantization scales, with num_key_value_heads grown to
    the layout's count."""
    _, target_kv_heads = attention_head_counts(config)
    source_kv_heads = config.num_key_value_heads
    if target_kv_heads == source_kv_heads:
        return state_dict
    head_dim = head_dim_of(config)
    return {
        key: replicate_kv_heads(tensor, source_kv_heads, target_kv_heads, head_dim)
        if _is_replicated(key, tensor)
        else tensor
        for key, tensor in state_dict.items()
    }
