"""GPT-NeoX for nxdplug: the decoder math, built from nxdplug's modules.

What sets GPT-NeoX apart from Llama: LayerNorm with a bias, biases on every projection, a plain
(ungated) MLP, rotary positions on only the first ``rotary_ndims`` dims of each head, and,
with ``use_parallel_residual``, attention and MLP both reading the layer's input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from nxdplug.plugin_api import (
    CacheSlot,
    ColumnParallelLinear,
    InferenceConfig,
    NeuronAttentionBase,
    NeuronBaseForCausalLM,
    NeuronBaseModel,
    ParallelEmbedding,
    RotaryEmbedding,
    RowParallelLinear,
    activation,
    head_dim_of,
    rope_parameters,
    tp_rank,
    tp_world_size,
)

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

# HF's default when a config gives neither rope_parameters' factor nor rotary_pct.
DEFAULT_ROTARY_FRACTION = 0.25


def rotary_ndims(config: InferenceConfig) -> int:
    """How many leading dims of each head rotary positions turn.

    transformers 5 keeps the fraction as ``rope_parameters["partial_rotary_factor"]``; older
    configs call it ``rotary_pct``.
    """
    params = getattr(config, "rope_parameters", None) or {}
    fraction = params.get("partial_rotary_factor")
    if fraction is None:
        fraction = getattr(config, "rotary_pct", DEFAULT_ROTARY_FRACTION)
    return int(head_dim_of(config) * fraction)


class GPTNeoXInferenceConfig(InferenceConfig):
    def add_derived_config(self) -> None:
        # GPT-NeoX attention is multi-head; nxdplug's attention reads the K/V head count here.
        if hasattr(self, "num_attention_heads"):
            self.num_key_value_heads = self.num_attention_heads

    def get_required_attributes(self) -> list[str]:
        return [
            "hidden_size",
            "num_attention_heads",
            "num_hidden_layers",
            "vocab_size",
            "max_position_embeddings",
            "layer_norm_eps",
            "intermediate_size",
            "hidden_act",
            "use_parallel_residual",
        ]


class GPTNeoXMLP(nn.Module):
    """dense_4h_to_h(act(dense_h_to_4h(x))), both with biases."""

    def __init__(self, config: InferenceConfig) -> None:
        super().__init__()
        tp = {"tp_degree": tp_world_size(), "rank": tp_rank()}
        hidden, intermediate = config.hidden_size, config.intermediate_size
        self.dense_h_to_4h = ColumnParallelLinear(hidden, intermediate, bias=True, **tp)
        self.dense_4h_to_h = RowParallelLinear(
            intermediate,
            hidden,
            bias=True,
            reduce_dtype=config.neuron_config.rpl_reduce_dtype,
            **tp,
        )
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class GPTNeoXDecoderLayer(nn.Module):
    """Parallel residual: x + attn(ln1(x)) + mlp(ln2(x)). Sequential: h = x + attn(ln1(x)),
    then h + mlp(ln2(h))."""

    def __init__(self, config: InferenceConfig, layer_idx: int) -> None:
        super().__init__()
        self.use_parallel_residual = bool(config.use_parallel_residual)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        bias = bool(getattr(config, "attention_bias", True))
        # The rotary table is rotary_ndims wide, so only those dims of each head turn.
        self.self_attn = NeuronAttentionBase(config, layer_idx, qkv_bias=bias, o_bias=bias)
        self.mlp = GPTNeoXMLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: CacheSlot,
    ) -> torch.Tensor:
        attention = self.self_attn(self.input_layernorm(x), rope, mask, cache)
        if self.use_parallel_residual:
            return x + attention + self.mlp(self.post_attention_layernorm(x))
        h = x + attention
        return h + self.mlp(self.post_attention_layernorm(h))


class NeuronGPTNeoXModel(NeuronBaseModel):
    def init_model(self, config: InferenceConfig) -> None:
        tp = {"tp_degree": tp_world_size(), "rank": tp_rank()}
        self.embed_tokens = ParallelEmbedding(config.vocab_size, config.hidden_size, **tp)
        self.layers = nn.ModuleList(
            GPTNeoXDecoderLayer(config, index) for index in range(config.num_hidden_layers)
        )
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.lm_head = ColumnParallelLinear(
            config.hidden_size, config.vocab_size, bias=False, gather_output=True, **tp
        )
        self.rotary_emb = RotaryEmbedding(rotary_ndims(config), rope_parameters(config))


class NeuronGPTNeoXForCausalLM(NeuronBaseForCausalLM):
    _model_cls = NeuronGPTNeoXModel
    _STATE_DICT_MODEL_PREFIX = "gpt_neox."

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return GPTNeoXInferenceConfig
