"""Mixtral for nxdplug: Llama's attention, and a sparse MLP of routed experts in every layer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
from torch import nn

from nxdplug.contrib_models.llama.modeling_llama import (
    NeuronLlamaDecoderLayer,
    NeuronLlamaForCausalLM,
    NeuronLlamaModel,
)
from nxdplug.plugin_api import (
    ConfigError,
    InferenceConfig,
    MoENeuronConfig,
    NeuronConfig,
    initialize_moe_module,
    moe_neuron_config_problems,
)

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig


@attrs.define(slots=False, init=False, eq=False, repr=False, kw_only=True)
class MixtralNeuronConfig(MoENeuronConfig):
    """MoENeuronConfig for Mixtral, whose experts are SwiGLU MLPs: ``glu_mlp`` (True unless
    set) must stay True."""


class MixtralInferenceConfig(InferenceConfig):
    def get_required_attributes(self) -> list[str]:
        return [
            "hidden_size",
            "num_attention_heads",
            "num_hidden_layers",
            "num_key_value_heads",
            "vocab_size",
            "max_position_embeddings",
            "rms_norm_eps",
            "intermediate_size",
            "hidden_act",
            "num_local_experts",
            "num_experts_per_tok",
        ]

    def validate_config(self) -> None:
        super().validate_config()
        problems = moe_neuron_config_problems(self.neuron_config, "Mixtral", "MixtralNeuronConfig")
        if problems:
            raise ConfigError(problems)
        if not self.neuron_config.glu_mlp:
            raise ConfigError(["Mixtral's experts are gated MLPs: set glu_mlp=True"])

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return MixtralNeuronConfig


class NeuronMixtralDecoderLayer(NeuronLlamaDecoderLayer):
    """Llama's layer with a mixture-of-experts block for its MLP."""

    def __init__(self, config: InferenceConfig, layer_idx: int) -> None:
        window = getattr(config, "sliding_window", None)
        super().__init__(
            config, layer_idx, sliding_window=window, mlp=initialize_moe_module(config)
        )


class NeuronMixtralModel(NeuronLlamaModel):
    def make_decoder_layer(self, config: InferenceConfig, index: int) -> nn.Module:
        return NeuronMixtralDecoderLayer(config, index)


class NeuronMixtralForCausalLM(NeuronLlamaForCausalLM):
    _model_cls = NeuronMixtralModel

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return MixtralInferenceConfig
