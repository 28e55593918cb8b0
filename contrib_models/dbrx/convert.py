"""HF DBRX checkpoints to nxdplug: key renames as a table, and two tensor transforms per layer.

After the application strips ``transformer.``, an HF DBRX checkpoint has ``wte``, ``norm_f``,
``lm_head`` and, per block, ``blocks.L.norm_attn_norm.{norm_1, norm_2, attn.Wqkv, attn.out_proj}``
and ``blocks.L.ffn.{router.layer, experts.mlp.w1, experts.mlp.v1, experts.mlp.w2}``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nxdplug.contrib_models.llama.convert import convert_hf_llama_state_dict
from nxdplug.plugin_api import head_dim_of

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

# HF name -> nxdplug name, for whole keys outside the blocks.
MODEL_RENAMES = {
    "wte.weight": "embed_tokens.weight",
    "norm_f.weight": "norm.weight",
}

# HF name -> nxdplug name, inside ``blocks.L.`` (which becomes ``layers.L.``).
LAYER_RENAMES = {
    "norm_attn_norm.norm_1.weight": "input_layernorm.weight",
    "norm_attn_norm.norm_2.weight": "post_attention_layernorm.weight",
    "norm_attn_norm.attn.out_proj.weight": "self_attn.o_proj.weight",
    "ffn.router.layer.weight": "ffn.router.linear_router.weight",
}

FUSED_QKV = "norm_attn_norm.attn.Wqkv.weight"
EXPERTS = "ffn.experts.mlp"


def convert_hf_dbrx_state_dict(
    state_dict: dict[str, torch.Tensor], config: InferenceConfig
) -> dict[str, torch.Tensor]:
    """Rename DBRX's keys to the decoder's; split each ``Wqkv`` into ``q_proj``, ``k_proj`` and
    ``v_proj`` (so GQA replication and ``fused_qkv`` treat it as any other checkpoint), and turn
    the experts' flat ``w1`` (gate), ``v1`` (up) and ``w2`` (down), each
    [experts * ffn_hidden_size, d_model], into ``ffn.expert_mlps.gate_up_proj``
    [experts, 2 * ffn_hidden_size, d_model] and ``ffn.expert_mlps.down_proj``
    [experts, d_model, ffn_hidden_size]. Keys that are absent are left alone."""
    converted = {MODEL_RENAMES.get(key, key): tensor for key, tensor in state_dict.items()}
    for layer in range(config.num_hidden_layers):
        old, new = f"blocks.{layer}", f"layers.{layer}"
        for key in [k for k in converted if k.startswith(f"{old}.")]:
            name = key[len(old) + 1 :]
            converted[f"{new}.{LAYER_RENAMES.get(name, name)}"] = converted.pop(key)
        if f"{new}.{FUSED_QKV}" in converted:
            split_fused_qkv(converted, f"{new}.{FUSED_QKV}", f"{new}.self_attn", config)
        if f"{new}.{EXPERTS}.w1" in converted:
            stack_flat_experts(converted, f"{new}.{EXPERTS}", f"{new}.ffn.expert_mlps", config)
    return convert_hf_llama_state_dict(converted, config)


def split_fused_qkv(
    state_dict: dict[str, torch.Tensor], key: str, target: str, config: InferenceConfig
) -> None:
    """``key`` [q rows, then k rows, then v rows; hidden] -> ``{target}.{q,k,v}_proj.weight``."""
    head_dim = head_dim_of(config)
    q_size = config.num_attention_heads * head_dim
    kv_size = config.num_key_value_heads * head_dim
    parts = state_dict.pop(key).split([q_size, kv_size, kv_size], dim=0)
    for name, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
        state_dict[f"{target}.{name}.weight"] = part.contiguous()


def stack_flat_experts(
    state_dict: dict[str, torch.Tensor], source: str, target: str, config: InferenceConfig
) -> None:
    """``{source}.{w1,v1,w2}`` -> ``{target}.gate_up_proj`` and ``{target}.down_proj``."""
    shape = (config.num_local_experts, config.intermediate_size, config.hidden_size)
    gate, up, down = (state_dict.pop(f"{source}.{name}").view(shape) for name in ("w1", "v1", "w2"))
    state_dict[f"{target}.gate_up_proj"] = torch.cat([gate, up], dim=1)
    # HF computes h @ w2_e, so w2_e is [ffn_hidden_size, d_model]: the transpose of down_proj.
    state_dict[f"{target}.down_proj"] = down.transpose(1, 2).contiguous()
