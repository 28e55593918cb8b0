"""GPT-OSS (attention sinks, alternating sliding windows, clamped-SwiGLU experts) as a model
plugin."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import ModelArchitecture, StateDictConverter, hookimpl

NXDPLUG_API_VERSION = 2

MODULE = "nxdplug.contrib_models.gpt_oss.modeling_gpt_oss"


@hookimpl
def nxdplug_model_architectures() -> Iterable[ModelArchitecture]:
    yield ModelArchitecture(
        name="gpt_oss",
        model_type="gpt_oss",
        hf_architectures=("GptOssForCausalLM",),
        application=f"{MODULE}:NeuronGptOssForCausalLM",
        config_class=f"{MODULE}:GptOssInferenceConfig",
        hf_config_class="transformers:GptOssConfig",
        hf_model_class="transformers:GptOssForCausalLM",
        capabilities={"gqa", "fused_qkv", "sliding_window", "rope_scaling"},
        description="GPT-OSS mixture-of-experts decoders (attention sinks, YaRN rope)",
    )


@hookimpl
def nxdplug_state_dict_converters() -> Iterable[StateDictConverter]:
    yield StateDictConverter(
        name="gpt_oss-hf",
        converter="nxdplug.contrib_models.gpt_oss.convert:convert_hf_gpt_oss_state_dict",
        model_types=("gpt_oss",),
        order=10,
        description="interleaved gate/up experts split and transposed; router renamed",
    )
