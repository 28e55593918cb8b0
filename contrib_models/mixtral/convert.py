"""HF Mixtral checkpoints to nxdplug: Llama's attention, and the sparse MLP's experts stacked."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nxdplug.contrib_models.llama.convert import convert_hf_llama_state_dict
from nxdplug.plugin_api import stack_gated_experts

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig


def convert_hf_mixtral_state_dict(
    state_dict: dict[str, torch.Tensor], config: InferenceConfig
) -> dict[str, torch.Tensor]:
    """``layers.L.block_sparse_moe.gate`` becomes ``layers.L.mlp.router.linear_router``, and
    the per-expert ``w1`` (gate), ``w3`` (up) and ``w2`` (down) become the stacked weights of
    ``layers.L.mlp.expert_mlps``. Checkpoints in transformers' fused layout (``mlp.gate``,
    ``mlp.experts.gate_up_proj``) are renamed only."""
    converted = convert_hf_llama_state_dict(state_dict, config)
    for layer in range(config.num_hidden_layers):
        old, new = f"layers.{layer}.block_sparse_moe", f"layers.{layer}.mlp"
        if f"{old}.gate.weight" in converted:
            converted[f"{new}.router.linear_router.weight"] = converted.pop(f"{old}.gate.weight")
            stack_gated_experts(
                converted,
                gate=f"{old}.experts.{{}}.w1.weight",
                up=f"{old}.experts.{{}}.w3.weight",
                down=f"{old}.experts.{{}}.w2.weight",
                num_experts=config.num_local_experts,
                target=f"{new}.expert_mlps",
            )
        elif f"{new}.gate.weight" in converted:
            converted[f"{new}.router.linear_router.weight"] = converted.pop(f"{new}.gate.weight")
            for name in ("gate_up_proj", "down_proj"):
                converted[f"{new}.expert_mlps.{name}"] = converted.pop(f"{new}.experts.{name}")
    return converted
