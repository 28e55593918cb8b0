"""HF GPT-OSS checkpoints to nxdplug: the experts' fused tensors in the building blocks' layout.

transformers stores ``mlp.experts.gate_up_proj`` as [experts, hidden, 2 * inner] with the gate
and up columns interleaved (gate, up, gate, up, ...) and ``down_proj`` as [experts, inner,
hidden]; :class:`~nxdplug.modules.moe.ExpertMLPs` holds [experts, 2 * inner, hidden] (all gate
rows, then all up rows) and [experts, hidden, inner].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from nxdplug.contrib_models.llama.convert import convert_hf_llama_state_dict
from nxdplug.plugin_api import CheckpointError

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig


def deinterleave(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2n] with gate and up alternating -> [..., 2n] with the n gate values first."""
    return torch.cat((gate_up[..., ::2], gate_up[..., 1::2]), dim=-1)


def transposed(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.transpose(1, 2).contiguous()


def kept(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


# HF name under layers.L.mlp -> (nxdplug name under layers.L.mlp, transform)
MLP_TENSORS: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {
    "router.weight": ("router.linear_router.weight", kept),
    "router.bias": ("router.linear_router.bias", kept),
    "experts.gate_up_proj": ("expert_mlps.gate_up_proj", lambda t: transposed(deinterleave(t))),
    "experts.gate_up_proj_bias": ("expert_mlps.gate_up_proj_bias", deinterleave),
    "experts.down_proj": ("expert_mlps.down_proj", transposed),
    "experts.down_proj_bias": ("expert_mlps.down_proj_bias", kept),
}

MXFP4_SUFFIXES = ("_blocks", "_scales")


def convert_hf_gpt_oss_state_dict(
    state_dict: dict[str, torch.Tensor], config: InferenceConfig
) -> dict[str, torch.Tensor]:
    """Rename and re-lay the MLP tensors of every layer (:data:`MLP_TENSORS`); attention,
    sinks and norms keep their names. MXFP4-packed experts arrive dequantized (the quantization
    plugin reads them, :mod:`nxdplug.plugins.quantization.formats.mxfp4`); packed ones are
    refused."""
    packed = sorted(name for name in state_dict if name.endswith(MXFP4_SUFFIXES))
    if packed:
        raise CheckpointError(
            f"this GPT-OSS checkpoint holds MXFP4-packed expert weights ({packed[0]}, ...), "
            "but its config.json has no quantization_config with quant_method 'mxfp4', which "
            "is what makes the quantization plugin read them: add it, or dequantize the "
            "checkpoint first (transformers' Mxfp4Config(dequantize=True), save_pretrained)"
        )
    converted = convert_hf_llama_state_dict(state_dict, config)
    for layer in range(config.num_hidden_layers):
        mlp = f"layers.{layer}.mlp"
        for old, (new, transform) in MLP_TENSORS.items():
            if f"{mlp}.{old}" in converted:
                converted[f"{mlp}.{new}"] = transform(converted.pop(f"{mlp}.{old}"))
    return converted
