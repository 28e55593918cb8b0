"""Qwen3 (dense) as a model plugin: Llama's math with per-head Q/K RMSNorm."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import ModelArchitecture, StateDictConverter, hookimpl

NXDPLUG_API_VERSION = 2

MODULE = "nxdplug.contrib_models.qwen3.modeling_qwen3"


@hookimpl
def nxdplug_model_architectures() -> Iterable[ModelArchitecture]:
    yield ModelArchitecture(
        name="qwen3",
        model_type="qwen3",
        hf_architectures=("Qwen3ForCausalLM",),
        application=f"{MODULE}:NeuronQwen3ForCausalLM",
        config_class=f"{MODULE}:Qwen3InferenceConfig",
        hf_config_class="transformers:Qwen3Config",
        hf_model_class="transformers:Qwen3ForCausalLM",
        capabilities={"gqa", "fused_qkv", "qk_layernorm", "sliding_window", "tied_embeddings"},
        description="Qwen3 dense decoders (per-head Q/K norms, explicit head_dim)",
    )


@hookimpl
def nxdplug_state_dict_converters() -> Iterable[StateDictConverter]:
    yield StateDictConverter(
        name="qwen3-hf",
        converter="nxdplug.contrib_models.llama.convert:convert_hf_llama_state_dict",
        model_types=("qwen3",),
        order=10,
        description="same layout as Llama, with self_attn.q_norm / k_norm kept as they are",
    )
