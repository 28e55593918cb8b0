"""Qwen3-MoE (sparse mixture of experts with per-head Q/K norms) as a model plugin."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import ModelArchitecture, StateDictConverter, hookimpl

NXDPLUG_API_VERSION = 2

MODULE = "nxdplug.contrib_models.qwen3_moe.modeling_qwen3_moe"


@hookimpl
def nxdplug_model_architectures() -> Iterable[ModelArchitecture]:
    yield ModelArchitecture(
        name="qwen3_moe",
        model_type="qwen3_moe",
        hf_architectures=("Qwen3MoeForCausalLM",),
        application=f"{MODULE}:NeuronQwen3MoeForCausalLM",
        config_class=f"{MODULE}:Qwen3MoeInferenceConfig",
        hf_config_class="transformers:Qwen3MoeConfig",
        hf_model_class="transformers:Qwen3MoeForCausalLM",
        capabilities={"gqa", "fused_qkv", "qk_layernorm", "sliding_window", "tied_embeddings"},
        # transformers' defaults are 128 experts of width 768: 38M parameters for a tiny model
        tiny_config={"num_experts": 8, "moe_intermediate_size": 32},
        description="Qwen3-MoE decoders (top-k routed gated experts, per-head Q/K norms)",
    )


@hookimpl
def nxdplug_state_dict_converters() -> Iterable[StateDictConverter]:
    yield StateDictConverter(
        name="qwen3_moe-hf",
        converter="nxdplug.contrib_models.qwen3_moe.convert:convert_hf_qwen3_moe_state_dict",
        model_types=("qwen3_moe",),
        order=10,
        description="per-expert gate/up/down stacked; router renamed; dense layers kept",
    )
