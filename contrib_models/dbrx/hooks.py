"""DBRX (fine-grained mixture of experts, clipped fused QKV) as a model plugin."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import ModelArchitecture, StateDictConverter, hookimpl

NXDPLUG_API_VERSION = 2

MODULE = "nxdplug.contrib_models.dbrx.modeling_dbrx"


@hookimpl
def nxdplug_model_architectures() -> Iterable[ModelArchitecture]:
    yield ModelArchitecture(
        name="dbrx",
        model_type="dbrx",
        hf_architectures=("DbrxForCausalLM",),
        application=f"{MODULE}:NeuronDbrxForCausalLM",
        config_class=f"{MODULE}:DbrxInferenceConfig",
        hf_config_class="transformers:DbrxConfig",
        hf_model_class="transformers:DbrxForCausalLM",
        capabilities={"gqa", "fused_qkv"},
        # DBRX keeps its sizes under its own names and in nested configs; transformers' DBRX
        # needs a rope_theta in attn_config and a numeric clip_qkv.
        tiny_config={
            "d_model": 64,
            "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
            "ffn_config": {"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 128},
        },
        description="DBRX mixture-of-experts decoders (top-k routed gated MLPs, clipped QKV)",
    )


@hookimpl
def nxdplug_state_dict_converters() -> Iterable[StateDictConverter]:
    yield StateDictConverter(
        name="dbrx-hf",
        converter="nxdplug.contrib_models.dbrx.convert:convert_hf_dbrx_state_dict",
        model_types=("dbrx",),
        order=10,
        description="blocks renamed; Wqkv split; flat w1/v1/w2 experts stacked",
    )
