"""Qwen2 as a model plugin: Llama's math with biases on the Q, K and V projections."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import ModelArchitecture, StateDictConverter, hookimpl

NXDPLUG_API_VERSION = 2

MODULE = "nxdplug.contrib_models.qwen2.modeling_qwen2"


@hookimpl
def nxdplug_model_architectures() -> Iterable[ModelArchitecture]:
    yield ModelArchitecture(
        name="qwen2",
        model_type="qwen2",
        hf_architectures=("Qwen2ForCausalLM",),
        application=f"{MODULE}:NeuronQwen2ForCausalLM",
        config_class=f"{MODULE}:Qwen2InferenceConfig",
        hf_config_class="transformers:Qwen2Config",
        hf_model_class="transformers:Qwen2ForCausalLM",
        capabilities={"gqa", "fused_qkv", "qkv_bias", "tied_embeddings"},
        description="Qwen2 and Qwen2.5 decoders",
    )


@hookimpl
def nxdplug_state_dict_converters() -> Iterable[StateDictConverter]:
    yield StateDictConverter(
        name="qwen2-hf",
        converter="nxdplug.contrib_models.llama.convert:convert_hf_llama_state_dict",
        model_types=("qwen2",),
        order=10,
        description="same layout as Llama, with Q/K/V biases",
    )
