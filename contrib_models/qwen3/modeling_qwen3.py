"""Qwen3 (dense) for nxdplug: the Llama decoder whose attention normalizes each query and key
head (RMSNorm over head_dim) before rotary, with an explicit head_dim, optional biases on every
attention projection and optional sliding-window layers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from nxdplug.contrib_models.llama.modeling_llama import (
    LlamaInferenceConfig,
    NeuronLlamaDecoderLayer,
    NeuronLlamaForCausalLM,
    NeuronLlamaModel,
)
from nxdplug.contrib_models.qwen2.modeling_qwen2 import layer_window
from nxdplug.plugin_api import InferenceConfig

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig


class Qwen3InferenceConfig(LlamaInferenceConfig):
    """Llama's required attributes and ``head_dim``, which Qwen3 never derives from the width."""

    def get_required_attributes(self) -> list[str]:
        return [*super().get_required_attributes(), "head_dim"]


class NeuronQwen3DecoderLayer(NeuronLlamaDecoderLayer):
    """Llama's layer with per-head Q/K norms, attention biases and per-layer windows."""

    def __init__(self, config: InferenceConfig, layer_idx: int) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(
            config,
            layer_idx,
            qkv_bias=bias,
            o_bias=bias,
            sliding_window=layer_window(config, layer_idx),
            qk_layernorm=True,
        )


class NeuronQwen3Model(NeuronLlamaModel):
    def make_decoder_layer(self, config: InferenceConfig, index: int) -> nn.Module:
        return NeuronQwen3DecoderLayer(config, index)


class NeuronQwen3ForCausalLM(NeuronLlamaForCausalLM):
    _model_cls = NeuronQwen3Model

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return Qwen3InferenceConfig
