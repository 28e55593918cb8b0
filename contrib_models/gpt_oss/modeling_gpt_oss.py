"""GPT-OSS for nxdplug: attention with biases and one learned sink per head, sliding-window and
full layers as ``layer_types`` says, YaRN rope, and in every layer a router (with a bias) whose
softmax is taken over the top-k logits, in front of experts with biases and a clamped SwiGLU:
``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import attrs
import torch
from torch import nn

from nxdplug.contrib_models.gpt_oss.rope_yarn import ROPE_TYPES, rotary_embedding
from nxdplug.contrib_models.llama.modeling_llama import NeuronLlamaDecoderLayer
from nxdplug.contrib_models.qwen2.modeling_qwen2 import layer_window
from nxdplug.plugin_api import (
    ColumnParallelLinear,
    ConfigError,
    InferenceConfig,
    MoENeuronConfig,
    NeuronAttentionBase,
    NeuronBaseForCausalLM,
    NeuronBaseModel,
    NeuronConfig,
    ParallelEmbedding,
    RMSNorm,
    agree_with_checkpoint,
    head_dim_of,
    initialize_moe_module,
    moe_neuron_config_problems,
    rope_parameters,
    shard_tensor,
    tp_rank,
    tp_world_size,
)

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

# transformers < 5 had no swiglu_alpha in the config: the value was fixed.
DEFAULT_SWIGLU_ALPHA = 1.702


@attrs.define(slots=False, init=False, eq=False, repr=False, kw_only=True)
class GptOssNeuronConfig(MoENeuronConfig):
    """MoENeuronConfig with GPT-OSS's expert numerics as defaults: the clamped SwiGLU
    ``gate * sigmoid(1.702 gate) * (up + 1)`` with gate <= 7 and -7 <= up <= 7, and the top-k
    softmax left as it is. A checkpoint's ``swiglu_alpha`` / ``swiglu_limit`` replace the
    defaults (see :meth:`GptOssInferenceConfig.add_derived_config`)."""

    glu_type: str = "swiglu"
    hidden_act_scaling_factor: float = DEFAULT_SWIGLU_ALPHA
    hidden_act_bias: float = 1.0
    gate_clamp_upper_limit: float | None = 7.0
    up_clamp_upper_limit: float | None = 7.0
    up_clamp_lower_limit: float | None = -7.0
    normalize_top_k_affinities: bool = False


class GptOssInferenceConfig(InferenceConfig):
    def get_required_attributes(self) -> list[str]:
        return [
            "hidden_size",
            "num_attention_heads",
            "num_hidden_layers",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
            "rms_norm_eps",
            "intermediate_size",
            "num_local_experts",
            "num_experts_per_tok",
            "swiglu_limit",
            "layer_types",
            "sliding_window",
        ]

    def add_derived_config(self) -> None:
        """The experts' numerics from the checkpoint: a setting left at its class default takes
        the checkpoint's value, one set otherwise must agree with it."""
        super().add_derived_config()
        if not isinstance(self.neuron_config, MoENeuronConfig) or not hasattr(self, "swiglu_limit"):
            return  # validate_config says what is missing
        alpha = getattr(self, "swiglu_alpha", None) or DEFAULT_SWIGLU_ALPHA
        limit = self.swiglu_limit
        clamp = f"swiglu_limit={limit}"
        settings = {
            "glu_mlp": (True, "GPT-OSS's gated experts"),
            "glu_type": ("swiglu", "GPT-OSS's gate * act(alpha * gate) * (up + 1)"),
            "hidden_act_scaling_factor": (alpha, f"swiglu_alpha={alpha}"),
            "hidden_act_bias": (1.0, "GPT-OSS's (up + 1)"),
            "gate_clamp_upper_limit": (limit, clamp),
            "gate_clamp_lower_limit": (None, "GPT-OSS's gate clamped from above only"),
            "up_clamp_upper_limit": (limit, clamp),
            "up_clamp_lower_limit": (None if limit is None else -limit, clamp),
            "normalize_top_k_affinities": (False, "GPT-OSS's softmax over the top-k logits"),
        }
        self.neuron_config = agree_with_checkpoint(self.neuron_config, settings, "GPT-OSS")

    def validate_config(self) -> None:
        super().validate_config()
        problems = moe_neuron_config_problems(self.neuron_config, "GPT-OSS", "GptOssNeuronConfig")
        rope_type = rope_parameters(self)["rope_type"]
        if rope_type not in ROPE_TYPES:
            problems.append(
                f"rope_type {rope_type!r} is not implemented for GPT-OSS; supported: "
                f"{', '.join(ROPE_TYPES)}"
            )
        if problems:
            raise ConfigError(problems)

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return GptOssNeuronConfig


def attention_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """softmax([q k^T / sqrt(d), sink], masked) v without the sink's column: each query head's
    sink logit joins the softmax denominator, so a head may attend to nothing.

    q: [batch, heads, queries, dim]; k, v: [batch, kv_heads, keys, dim]; mask: boolean
    [batch, 1, queries, keys]; sinks: [heads]. Query head h reads K/V head h // (heads //
    kv_heads). The softmax is taken in float32.
    """
    batch, heads, queries, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    scores = (q.reshape(batch, kv_heads, groups * queries, dim) @ k.transpose(-1, -2)) * dim**-0.5
    scores = scores.view(batch, kv_heads, groups, queries, keys).float()
    scores = scores.masked_fill(~mask[:, :, None], torch.finfo(torch.float32).min)
    sink = sinks.float().view(1, kv_heads, groups, 1, 1).expand(batch, -1, -1, queries, 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :keys]
    probs = probs.to(v.dtype).reshape(batch, kv_heads, groups * queries, keys)
    return (probs @ v).view(batch, heads, queries, dim)


class NeuronGptOssAttention(NeuronAttentionBase):
    """The attention building block with biases on q/k/v/o and a learned sink per query head
    (``sinks``, split over tensor-parallel ranks with the heads)."""

    def __init__(self, config: InferenceConfig, layer_idx: int) -> None:
        bias = bool(getattr(config, "attention_bias", True))
        super().__init__(
            config,
            layer_idx,
            qkv_bias=bias,
            o_bias=bias,
            sliding_window=layer_window(config, layer_idx),
        )
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's heads' sinks (the projections shard themselves)."""
        return {name: shard_tensor(t, 0, tp_world_size(), tp_rank()) for name, t in full.items()}

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        dtype = self.attention_dtype or q.dtype
        return attention_with_sinks(q.to(dtype), k.to(dtype), v.to(dtype), mask, self.sinks)


def experts_config(config: InferenceConfig) -> InferenceConfig:
    """``config`` as initialize_moe_module reads it: the experts' activation is the sigmoid
    inside the clamped SwiGLU (the checkpoint's ``hidden_act`` names none of it)."""
    view = copy.copy(config)
    view.hidden_act = "sigmoid"
    return view


class NeuronGptOssDecoderLayer(NeuronLlamaDecoderLayer):
    """Llama's layer with sink attention and a mixture-of-experts block for its MLP."""

    def __init__(self, config: InferenceConfig, layer_idx: int) -> None:
        attention = NeuronGptOssAttention(config, layer_idx)
        experts = initialize_moe_module(
            experts_config(config),
            apply_act_fn_over_topk=True,
            router_bias=True,
            experts_bias=True,
        )
        super().__init__(config, layer_idx, attention=attention, mlp=experts)


class NeuronGptOssModel(NeuronBaseModel):
    def init_model(self, config: InferenceConfig) -> None:
        tp = {"tp_degree": tp_world_size(), "rank": tp_rank()}
        self.embed_tokens = ParallelEmbedding(config.vocab_size, config.hidden_size, **tp)
        self.layers = nn.ModuleList(
            NeuronGptOssDecoderLayer(config, index) for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = ColumnParallelLinear(
            config.hidden_size, config.vocab_size, bias=False, gather_output=True, **tp
        )
        self.rotary_emb = rotary_embedding(head_dim_of(config), rope_parameters(config))


class NeuronGptOssForCausalLM(NeuronBaseForCausalLM):
    _model_cls = NeuronGptOssModel

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return GptOssInferenceConfig
