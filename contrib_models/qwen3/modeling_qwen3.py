"""Qwen3 (dense) for nxdplug: the Llama decoder whose attention normalizes each query and key
head (RMSNorm over head_dim) before rotary, with an explicit head_dim, optional biases on every
attention projection and optional sliding-window layers."""

from __future__ import annotations

from typing import Any

from torch import nn

from nxdplug.config import InferenceConfig
from nxdplug.contrib_models.llama.modeling_llama import (
    LlamaInferenceConfig,
    NeuronLlamaForCausalLM,
    NeuronLlamaModel,
)
from nxdplug.contrib_models.qwen2.modeling_qwen2 import layer_window
from nxdplug.modules.attention import NeuronAttentionBase
from nxdplug.modules.decoder import PreNormDecoderLayer
from nxdplug.modules.mlp import GatedMLP
from nxdplug.modules.norms import RMSNorm


class Qwen3InferenceConfig(LlamaInferenceConfig):
    """Llama's required attributes and ``head_dim``, which Qwen3 never derives from the width."""

    def get_required_attributes(self) -> list[str]:
        return [*super().get_required_attributes(), "head_dim"]


class NeuronQwen3DecoderLayer(PreNormDecoderLayer):
    """x + attention(norm(x)), then h + mlp(norm(h)); the attention has per-head Q/K norms."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = NeuronAttentionBase(
            config,
            layer_idx,
            qkv_bias=bias,
            o_bias=bias,
            sliding_window=layer_window(config, layer_idx),
            qk_layernorm=True,
        )
        self.mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            reduce_dtype=config.neuron_config.rpl_reduce_dtype,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class NeuronQwen3Model(NeuronLlamaModel):
    def make_decoder_layer(self, config: Any, index: int) -> nn.Module:
        return NeuronQwen3DecoderLayer(config, index)


class NeuronQwen3ForCausalLM(NeuronLlamaForCausalLM):
    _model_cls = NeuronQwen3Model

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return Qwen3InferenceConfig
