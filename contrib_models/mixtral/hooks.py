"""Mixtral (sparse mixture of experts) as a model plugin."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import ModelArchitecture, StateDictConverter, hookimpl

NXDPLUG_API_VERSION = 2

MODULE = "nxdplug.contrib_models.mixtral.modeling_mixtral"


@hookimpl
def nxdplug_model_architectures() -> Iterable[ModelArchitecture]:
    yield ModelArchitecture(
        name="mixtral",
        model_type="mixtral",
        hf_architectures=("MixtralForCausalLM",),
        application=f"{MODULE}:NeuronMixtralForCausalLM",
        config_class=f"{MODULE}:MixtralInferenceConfig",
        hf_config_class="transformers:MixtralConfig",
        hf_model_class="transformers:MixtralForCausalLM",
        capabilities={"gqa", "fused_qkv"},
        description="Mixtral sparse mixture-of-experts decoders (top-k routed gated MLPs)",
    )


@hookimpl
def nxdplug_state_dict_converters() -> Iterable[StateDictConverter]:
    yield StateDictConverter(
        name="mixtral-hf",
        converter="nxdplug.contrib_models.mixtral.convert:convert_hf_mixtral_state_dict",
        model_types=("mixtral",),
        order=10,
        description="per-expert w1/w3/w2 stacked; router renamed",
    )
