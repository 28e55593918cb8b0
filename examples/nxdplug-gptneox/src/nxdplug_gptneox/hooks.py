"""The nxdplug plugin: GPT-NeoX's architecture record and its checkpoint conversion.

Only records are built here, with lazy ``"module:attribute"`` references, so listing plugins
imports neither torch nor the model code.
"""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import ModelArchitecture, StateDictConverter, hookimpl

# The nxdplug plugin API this module is written for; nxdplug refuses a module of another version.
NXDPLUG_API_VERSION = 2

MODELING = "nxdplug_gptneox.modeling"


@hookimpl
def nxdplug_model_architectures() -> Iterable[ModelArchitecture]:
    yield ModelArchitecture(
        name="gpt-neox",
        model_type="gpt_neox",
        hf_architectures=("GPTNeoXForCausalLM",),
        application=f"{MODELING}:NeuronGPTNeoXForCausalLM",
        config_class=f"{MODELING}:GPTNeoXInferenceConfig",
        hf_config_class="transformers:GPTNeoXConfig",
        hf_model_class="transformers:GPTNeoXForCausalLM",
        capabilities={"fused_qkv", "tied_embeddings"},
        description="GPT-NeoX and Pythia: partial rotary, parallel residual, LayerNorm",
    )


@hookimpl
def nxdplug_state_dict_converters() -> Iterable[StateDictConverter]:
    yield StateDictConverter(
        name="gpt-neox-hf",
        converter="nxdplug_gptneox.convert:convert_hf_gptneox_state_dict",
        model_types=("gpt_neox",),
        order=10,
        description="HF names to nxdplug's; fused per-head query_key_value split into q, k, v",
    )
