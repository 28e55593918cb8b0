"""Qwen2 for nxdplug: the Llama decoder with Q/K/V biases and optional sliding-window layers."""

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


class Qwen2InferenceConfig(LlamaInferenceConfig):
    """Llama's required attributes; sliding windows follow ``layer_types`` when present."""


def layer_window(config: InferenceConfig, index: int) -> int | None:
    """The attention window of layer ``index``: HF marks sliding layers in ``layer_types``."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return config.sliding_window if layer_types[index] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", False) and index >= config.max_window_layers:
        return config.sliding_window
    return None


class NeuronQwen2Model(NeuronLlamaModel):
    def make_decoder_layer(self, config: InferenceConfig, index: int) -> nn.Module:
        return NeuronLlamaDecoderLayer(
            config, index, qkv_bias=True, sliding_window=layer_window(config, index)
        )


class NeuronQwen2ForCausalLM(NeuronLlamaForCausalLM):
    _model_cls = NeuronQwen2Model

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return Qwen2InferenceConfig
