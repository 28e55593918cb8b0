"""HF Llama-layout checkpoints to nxdplug: the renames and small transforms, as data."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

# Keys HF checkpoints may carry that the model computes itself.
DROPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def convert_hf_llama_state_dict(
    state_dict: dict[str, torch.Tensor], config: InferenceConfig
) -> dict[str, torch.Tensor]:
    """Drop computed buffers and fill ``lm_head.weight`` from the embeddings when tied."""
    converted = {k: v for k, v in state_dict.items() if not k.endswith(DROPPED_SUFFIXES)}
    if "lm_head.weight" not in converted and getattr(config, "tie_word_embeddings", False):
        converted["lm_head.weight"] = converted["embed_tokens.weight"]
    return converted
