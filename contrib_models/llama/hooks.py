"""The Llama family (Llama 2, Llama 3.x) as a model plugin."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import ModelArchitecture, StateDictConverter, hookimpl

NXDPLUG_API_VERSION = 2

MODULE = "nxdplug.contrib_models.llama.modeling_llama"


@hookimpl
def nxdplug_model_architectures() -> Iterable[ModelArchitecture]:
    yield ModelArchitecture(
        name="llama",
        model_type="llama",
        hf_architectures=("LlamaForCausalLM",),
        application=f"{MODULE}:NeuronLlamaForCausalLM",
        config_class=f"{MODULE}:LlamaInferenceConfig",
        hf_config_class="transformers:LlamaConfig",
        hf_model_class="transformers:LlamaForCausalLM",
        capabilities={"gqa", "fused_qkv", "rope_scaling", "tied_embeddings"},
        description="Llama 2 and 3.x, including llama3 rope scaling",
    )


@hookimpl
def nxdplug_state_dict_converters() -> Iterable[StateDictConverter]:
    yield StateDictConverter(
        name="llama-hf",
        converter="nxdplug.contrib_models.llama.convert:convert_hf_llama_state_dict",
        model_types=("llama",),
        order=10,
        description="tied embeddings; rotary buffers dropped",
    )
