"""HF GPT-NeoX checkpoints to nxdplug's layout: renames and one tensor transform, as data.

The keys arrive without the ``gpt_neox.`` prefix (the application strips it). Attention
becomes ``self_attn`` with separate ``q_proj``/``k_proj``/``v_proj``, the names nxdplug's own
state-dict steps (fused QKV, GQA replication) and attention module work with.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

# (pattern, replacement) applied in turn to every key.
RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^embed_in\."), "embed_tokens."),
    (re.compile(r"^embed_out\."), "lm_head."),  # HF files keep it; transformers 5 renames on load
    (re.compile(r"^final_layer_norm\."), "norm."),
    (re.compile(r"\.attention\.dense\."), ".self_attn.o_proj."),
)

# Buffers older checkpoints carry that the model computes itself (causal mask, rotary table).
DROPPED = re.compile(r"\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)$")

QUERY_KEY_VALUE = re.compile(r"^(?P<layer>.+)\.attention\.query_key_value\.(?P<kind>weight|bias)$")


def split_query_key_value(
    fused: torch.Tensor, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K and V rows of GPT-NeoX's fused projection.

    Its output is laid out head by head, each head's ``[q, k, v]`` together (HF views it as
    ``[..., heads, 3 * head_dim]``), so the rows (weight ``[3 * hidden, hidden]`` or bias
    ``[3 * hidden]``) are grouped as ``[heads, 3, head_dim]``.
    """
    per_head = fused.reshape(num_heads, 3, -1, *fused.shape[1:])
    q, k, v = (per_head[:, part].reshape(-1, *fused.shape[1:]) for part in range(3))
    return q, k, v


def renamed(key: str) -> str:
    for pattern, replacement in RENAMES:
        key = pattern.sub(replacement, key)
    return key


def convert_hf_gptneox_state_dict(
    state_dict: dict[str, torch.Tensor], config: InferenceConfig
) -> dict[str, torch.Tensor]:
    """Rename, split ``query_key_value``, drop computed buffers, fill a tied ``lm_head``."""
    converted: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        if DROPPED.search(key):
            continue
        match = QUERY_KEY_VALUE.match(key)
        if match is None:
            converted[renamed(key)] = tensor
            continue
        parts = split_query_key_value(tensor, config.num_attention_heads)
        for name, part in zip("qkv", parts, strict=True):
            converted[f"{match['layer']}.self_attn.{name}_proj.{match['kind']}"] = part
    if "lm_head.weight" not in converted and getattr(config, "tie_word_embeddings", False):
        converted["lm_head.weight"] = converted["embed_tokens.weight"]
    return converted
