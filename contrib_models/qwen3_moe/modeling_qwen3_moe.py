"""Qwen3-MoE for nxdplug: Qwen3's attention (per-head Q/K RMSNorm, explicit head_dim), and in
each sparse layer a softmax router over ``num_experts`` gated experts of width
``moe_intermediate_size``; the layers ``mlp_only_layers`` / ``decoder_sparse_step`` leave dense
keep a gated MLP of width ``intermediate_size``."""

from __future__ import annotations

import copy
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
    agree_with_checkpoint,
    initialize_moe_module,
    moe_neuron_config_problems,
)

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig


@attrs.define(slots=False, init=False, eq=False, repr=False, kw_only=True)
class Qwen3MoeNeuronConfig(MoENeuronConfig):
    """MoENeuronConfig for Qwen3-MoE, whose experts are SwiGLU MLPs (``glu_mlp``, True unless
    set). ``normalize_top_k_affinities`` follows the checkpoint's ``norm_topk_prob``."""


class Qwen3MoeInferenceConfig(InferenceConfig):
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
            "moe_intermediate_size",
            "hidden_act",
            "num_local_experts",
            "num_experts_per_tok",
            "norm_topk_prob",
        ]

    def add_derived_config(self) -> None:
        """The experts' numerics as the checkpoint has them: gated (SwiGLU) experts, affinities
        renormalized over the top k exactly when ``norm_topk_prob`` says so."""
        super().add_derived_config()
        if not isinstance(self.neuron_config, MoENeuronConfig):
            return  # validate_config says what to use
        norm_topk_prob = getattr(self, "norm_topk_prob", None)
        settings = {
            "glu_mlp": (True, "Qwen3-MoE's gated experts"),
            "glu_type": ("glu", "Qwen3-MoE's act(gate) * up experts"),
            "hidden_act_scaling_factor": (1.0, "Qwen3-MoE's unscaled activation"),
            "hidden_act_bias": (0.0, "Qwen3-MoE's act(gate) * up experts"),
            "gate_clamp_upper_limit": (None, "Qwen3-MoE's unclamped experts"),
            "gate_clamp_lower_limit": (None, "Qwen3-MoE's unclamped experts"),
            "up_clamp_upper_limit": (None, "Qwen3-MoE's unclamped experts"),
            "up_clamp_lower_limit": (None, "Qwen3-MoE's unclamped experts"),
        }
        if norm_topk_prob is not None:
            settings["normalize_top_k_affinities"] = (
                bool(norm_topk_prob),
                f"norm_topk_prob={norm_topk_prob}",
            )
        self.neuron_config = agree_with_checkpoint(self.neuron_config, settings, "Qwen3-MoE")

    def validate_config(self) -> None:
        super().validate_config()
        problems = moe_neuron_config_problems(
            self.neuron_config, "Qwen3-MoE", "Qwen3MoeNeuronConfig"
        )
        if problems:
            raise ConfigError(problems)

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return Qwen3MoeNeuronConfig


def is_sparse_layer(config: InferenceConfig, index: int) -> bool:
    """Whether layer ``index`` routes over experts (HF's rule): not in ``mlp_only_layers``, and
    every ``decoder_sparse_step``-th layer."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        index not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_local_experts > 0
        and (index + 1) % step == 0
    )


def experts_config(config: InferenceConfig) -> InferenceConfig:
    """``config`` as initialize_moe_module reads it: the experts' width ``intermediate_size``
    is ``moe_intermediate_size`` (the dense layers keep the real ``intermediate_size``)."""
    view = copy.copy(config)
    view.intermediate_size = config.moe_intermediate_size
    return view


class NeuronQwen3MoeDecoderLayer(NeuronLlamaDecoderLayer):
    """Qwen3's attention (per-head Q/K norms); the MLP is routed experts in sparse layers and
    Llama's gated MLP in dense ones."""

    def __init__(self, config: InferenceConfig, layer_idx: int) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        window = config.sliding_window if getattr(config, "use_sliding_window", False) else None
        sparse = is_sparse_layer(config, layer_idx)
        super().__init__(
            config,
            layer_idx,
            qkv_bias=bias,
            o_bias=bias,
            sliding_window=window,
            qk_layernorm=True,
            mlp=initialize_moe_module(experts_config(config)) if sparse else None,
        )


class NeuronQwen3MoeModel(NeuronLlamaModel):
    def make_decoder_layer(self, config: InferenceConfig, index: int) -> nn.Module:
        return NeuronQwen3MoeDecoderLayer(config, index)


class NeuronQwen3MoeForCausalLM(NeuronLlamaForCausalLM):
    _model_cls = NeuronQwen3MoeModel

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return Qwen3MoeInferenceConfig
