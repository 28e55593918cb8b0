"""Mistral as a model plugin: Llama's math plus a sliding attention window."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import ModelArchitecture, StateDictConverter, hookimpl

NXDPLUG_API_VERSION = 2

MODULE = "nxdplug.contrib_models.mistral.modeling_mistral"


@hookimpl
def nxdplug_model_architectures() -> Iterable[ModelArchitecture]:
    yield ModelArchitecture(
        name="mistral",
        model_type="mistral",
        hf_architectures=("MistralForCausalLM",),
        application=f"{MODULE}:NeuronMistralForCausalLM",
        config_class=f"{MODULE}:MistralInferenceConfig",
        hf_config_class="transformers:MistralConfig",
        hf_model_class="transformers:MistralForCausalLM",
        capabilities={"gqa", "fused_qkv", "sliding_window"},
        description="Mistral 7B-style decoders with a sliding attention window",
    )


@hookimpl
def nxdplug_state_dict_converters() -> Iterable[StateDictConverter]:
    yield StateDictConverter(
        name="mistral-hf",
        converter="nxdplug.contrib_models.llama.convert:convert_hf_llama_state_dict",
        model_types=("mistral",),
        order=10,
        description="same layout as Llama",
    )
