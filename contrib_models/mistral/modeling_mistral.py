"""Mistral for nxdplug: the Llama decoder with a sliding attention window on every layer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from nxdplug.contrib_models.llama.modeling_llama import (
    LlamaInferenceConfig,
    NeuronLlamaDecoderLayer,
    NeuronLlamaForCausalLM,
    NeuronLlamaModel,
)
from nxdplug.plugin_api import InferenceConfig

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig


class MistralInferenceConfig(LlamaInferenceConfig):
    """Llama's required attributes; ``sliding_window`` is optional (None: full attention)."""


class NeuronMistralModel(NeuronLlamaModel):
    def make_decoder_layer(self, config: InferenceConfig, index: int) -> nn.Module:
        window = getattr(config, "sliding_window", None)
        return NeuronLlamaDecoderLayer(config, index, sliding_window=window)


class NeuronMistralForCausalLM(NeuronLlamaForCausalLM):
    _model_cls = NeuronMistralModel

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return MistralInferenceConfig
