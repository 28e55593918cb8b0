"""Llama (2 and 3.x) for nxdplug: the decoder math, in the layout of HF checkpoints."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from nxdplug.plugin_api import (
    CacheSlot,
    ColumnParallelLinear,
    GatedMLP,
    InferenceConfig,
    NeuronAttentionBase,
    NeuronBaseForCausalLM,
    NeuronBaseModel,
    NeuronConfig,
    ParallelEmbedding,
    RMSNorm,
    RotaryEmbedding,
    gather_sequence,
    head_dim_of,
    rope_parameters,
    scatter_sequence,
    tp_rank,
    tp_world_size,
    without_router_outputs,
)

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig


class LlamaNeuronConfig(NeuronConfig):
    """NeuronConfig for Llama; no extra attributes, kept for NxD Inference scripts."""


def get_updated_configs(config: InferenceConfig) -> list[InferenceConfig]:
    """NxD Inference's per-layer configs: ``config`` for each decoder layer, or for a layer
    whose MLP ``modules_to_not_convert`` names, a copy with the quantized-MLP kernel settings
    off (Neuron kernel hints: no effect on the CPU and CUDA backends)."""
    skipped = config.neuron_config.modules_to_not_convert or []
    configs = []
    for layer in range(config.num_hidden_layers):
        if not any(f"layers.{layer}.mlp" in module for module in skipped):
            configs.append(config)
            continue
        plain = copy.deepcopy(config)
        plain.neuron_config.quantized_mlp_kernel_enabled = False
        plain.neuron_config.activation_quantization_type = None
        plain.neuron_config.quantize_clamp_bound = float("inf")
        configs.append(plain)
    return configs


class LlamaInferenceConfig(InferenceConfig):
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
        ]

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return LlamaNeuronConfig


class NeuronLlamaDecoderLayer(nn.Module):
    """x + attention(norm(x)), then h + mlp(norm(h)).

    The attention's variants are arguments (biases, a sliding window, per-head Q/K norms);
    ``attention`` replaces the attention block (one that weighs keys otherwise; the other
    attention arguments then do not apply) and ``mlp`` the gated MLP (a mixture-of-experts
    block).

    With the sequence split over the tensor-parallel ranks (``sequence_parallel_enabled``),
    ``x`` is this rank's slice: the norms and residual adds work on it, and each block reads
    the gathered sequence and gives back this rank's slice of its output.
    """

    takes_sequence_slice: ClassVar[bool] = True

    def __init__(
        self,
        config: InferenceConfig,
        layer_idx: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        sliding_window: int | None = None,
        qk_layernorm: bool = False,
        attention: nn.Module | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if attention is None:
            attention = NeuronAttentionBase(
                config,
                layer_idx,
                qkv_bias=qkv_bias,
                o_bias=o_bias,
                sliding_window=sliding_window,
                qk_layernorm=qk_layernorm,
            )
        self.self_attn = attention
        if mlp is None:
            mlp = GatedMLP(
                config.hidden_size,
                config.intermediate_size,
                config.hidden_act,
                bias=bool(getattr(config, "mlp_bias", False)),
                reduce_dtype=config.neuron_config.rpl_reduce_dtype,
            )
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: CacheSlot,
    ) -> torch.Tensor:
        attended = self.self_attn(gather_sequence(self.input_layernorm(x)), rope, mask, cache)
        h = x + scatter_sequence(attended)
        out = self.mlp(gather_sequence(self.post_attention_layernorm(h)))
        return h + scatter_sequence(without_router_outputs(out))


class NeuronLlamaModel(NeuronBaseModel):
    """Embedding, decoder layers, final norm, LM head. The forward is the runtime's
    (:meth:`NeuronBaseModel.hidden_states`): ``x = embed_tokens(ids)``, then ``x = layer(x,
    rope, mask, cache)`` for each layer, then ``norm(x)``, whose last token (a prompt) or
    every token (decoding) ``lm_head`` scores."""

    def init_model(self, config: InferenceConfig) -> None:
        tp = {"tp_degree": tp_world_size(), "rank": tp_rank()}
        self.embed_tokens = ParallelEmbedding(config.vocab_size, config.hidden_size, **tp)
        self.layers = nn.ModuleList(
            self.make_decoder_layer(config, index) for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = ColumnParallelLinear(
            config.hidden_size, config.vocab_size, bias=False, gather_output=True, **tp
        )
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), rope_parameters(config))

    def make_decoder_layer(self, config: InferenceConfig, index: int) -> nn.Module:
        """One decoder layer; model families that differ only here override this."""
        return NeuronLlamaDecoderLayer(config, index)


class NeuronLlamaForCausalLM(NeuronBaseForCausalLM):
    _model_cls = NeuronLlamaModel

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return LlamaInferenceConfig
