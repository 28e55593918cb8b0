"""HF Qwen3-MoE checkpoints to nxdplug: Qwen3's attention, and the sparse layers' experts
stacked."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nxdplug.contrib_models.llama.convert import convert_hf_llama_state_dict
from nxdplug.plugin_api import stack_gated_experts

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig


def convert_hf_qwen3_moe_state_dict(
    state_dict: dict[str, torch.Tensor], config: InferenceConfig
) -> dict[str, torch.Tensor]:
    """In each sparse layer ``mlp.gate`` becomes ``mlp.router.linear_router`` and the
    per-expert ``gate_proj``, ``up_proj`` and ``down_proj`` become the stacked weights of
    ``mlp.expert_mlps``; checkpoints in transformers' fused layout (``mlp.experts.gate_up_proj``
    [experts, 2 * inner, hidden], ``mlp.experts.down_proj``) are renamed only. Dense layers
    (``mlp_only_layers``, ``decoder_sparse_step``) keep their ``gate_proj`` / ``up_proj`` /
    ``down_proj``."""
    converted = convert_hf_llama_state_dict(state_dict, config)
    for layer in range(config.num_hidden_layers):
        mlp = f"layers.{layer}.mlp"
        if f"{mlp}.gate.weight" not in converted:
            continue
        converted[f"{mlp}.router.linear_router.weight"] = converted.pop(f"{mlp}.gate.weight")
        if f"{mlp}.experts.gate_up_proj" in converted:
            for name in ("gate_up_proj", "down_proj"):
                converted[f"{mlp}.expert_mlps.{name}"] = converted.pop(f"{mlp}.experts.{name}")
            continue
        stack_gated_experts(
            converted,
            gate=f"{mlp}.experts.{{}}.gate_proj.weight",
            up=f"{mlp}.experts.{{}}.up_proj.weight",
            down=f"{mlp}.experts.{{}}.down_proj.weight",
            num_experts=config.num_local_experts,
            target=f"{mlp}.expert_mlps",
        )
    return converted
