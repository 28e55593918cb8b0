"""DBRX for nxdplug: attention with clipped Q/K/V, and a sparse MLP of routed experts in every
layer, between bias-free LayerNorms."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import nn

from nxdplug.plugin_api import (
    CacheSlot,
    ColumnParallelLinear,
    ConfigError,
    InferenceConfig,
    MoENeuronConfig,
    NeuronAttentionBase,
    NeuronBaseForCausalLM,
    NeuronBaseModel,
    NeuronConfig,
    ParallelEmbedding,
    RotaryEmbedding,
    agree_with_checkpoint,
    head_dim_of,
    initialize_moe_module,
    moe_neuron_config_problems,
    rope_parameters,
    tp_rank,
    tp_world_size,
    without_router_outputs,
)

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

# DBRX's LayerNorms have no bias and torch's default eps; its config names neither.
LAYER_NORM_EPS = 1e-5

# The flat attributes the building blocks read, from DBRX's nested config: flat name ->
# (section, key, transformers' default for a key the section leaves out).
NESTED_ATTRIBUTES: dict[str, tuple[str, str, Any]] = {
    "num_key_value_heads": ("attn_config", "kv_n_heads", 1),
    "clip_qkv": ("attn_config", "clip_qkv", None),
    "num_local_experts": ("ffn_config", "moe_num_experts", 4),
    "num_experts_per_tok": ("ffn_config", "moe_top_k", 1),
    "intermediate_size": ("ffn_config", "ffn_hidden_size", 3584),
    "moe_normalize_expert_weights": ("ffn_config", "moe_normalize_expert_weights", 1.0),
}


def section_value(section: Any, key: str, default: Any) -> Any:
    """``section[key]`` of a nested config given as a dict or as a transformers sub-config."""
    if isinstance(section, Mapping):
        return section.get(key, default)
    return getattr(section, key, default)


def top_k_weighting(p: float | None, top_k: int) -> tuple[bool, bool]:
    """How the building blocks reproduce DBRX's expert weights, ``w / ||w||_p`` over the top-k
    softmax affinities (``moe_normalize_expert_weights = p``, None: no normalization).

    Returns (``normalize_top_k_affinities``, ``apply_act_fn_over_topk``): p = 1 divides by the
    sum; with one expert per token every p gives a weight of 1, which the softmax over the
    chosen logit alone gives too. Other norms are not expressible and are refused.
    """
    if p is None:
        return False, False
    if top_k == 1:
        return False, True
    if p == 1:
        return True, False
    raise ConfigError(
        [
            f"ffn_config.moe_normalize_expert_weights is {p!r}: DBRX's expert weights divided "
            "by their L-p norm are implemented for p = 1 (divide by the sum) and None (no "
            "normalization) only, or for any p with moe_top_k = 1"
        ]
    )


@attrs.define(slots=False, init=False, eq=False, repr=False, kw_only=True)
class DbrxNeuronConfig(MoENeuronConfig):
    """MoENeuronConfig for DBRX, whose experts are GLU MLPs (``glu_mlp``, True unless set).
    ``normalize_top_k_affinities`` follows the checkpoint's ``moe_normalize_expert_weights``."""


class DbrxInferenceConfig(InferenceConfig):
    """DBRX's attributes, with the flat names the building blocks read.

    ``d_model``, ``n_heads``, ``n_layers`` and ``max_seq_len`` are reached as ``hidden_size``,
    ``num_attention_heads``, ``num_hidden_layers`` and ``max_position_embeddings`` (aliases, as
    in transformers' DbrxConfig). ``attn_config`` and ``ffn_config`` decide the attributes in
    :data:`NESTED_ATTRIBUTES`, ``hidden_act`` (``ffn_act_fn["name"]``) and the rope theta
    (``attn_config["rope_theta"]``, which transformers 5 ignores for its top-level
    ``rope_parameters``). The MoENeuronConfig is made to agree with the checkpoint (gated,
    unclamped experts; ``normalize_top_k_affinities`` from ``moe_normalize_expert_weights``):
    a field left at its default follows it, a contradicting one is refused.
    """

    attribute_map = {
        "num_attention_heads": "n_heads",
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "max_position_embeddings": "max_seq_len",
    }

    def add_derived_config(self) -> None:
        super().add_derived_config()
        attn, ffn = getattr(self, "attn_config", None), getattr(self, "ffn_config", None)
        sections = {"attn_config": attn, "ffn_config": ffn}
        for name, (section, key, default) in NESTED_ATTRIBUTES.items():
            if sections[section] is not None:
                setattr(self, name, section_value(sections[section], key, default))
        theta = section_value(attn, "rope_theta", None) if attn is not None else None
        if theta is not None:
            self.rope_theta = theta
            params = dict(getattr(self, "rope_parameters", None) or {"rope_type": "default"})
            self.rope_parameters = {**params, "rope_theta": theta}
        if ffn is None:
            return  # validate_config names what is missing
        act = section_value(ffn, "ffn_act_fn", None) or {}
        self.hidden_act = section_value(act, "name", "silu")
        if isinstance(self.neuron_config, MoENeuronConfig):  # else validate_config says so
            self.neuron_config = agree_with_checkpoint(
                self.neuron_config, self.checkpoint_settings(), "DBRX"
            )

    def checkpoint_settings(self) -> dict[str, tuple[Any, str]]:
        """The MoENeuronConfig fields DBRX's checkpoint decides: (value, why)."""
        p = self.moe_normalize_expert_weights
        normalize, _ = top_k_weighting(p, self.num_experts_per_tok)
        unclamped = (None, "DBRX's unclamped experts")
        return {
            "glu_mlp": (True, "DBRX's gated experts"),
            "glu_type": ("glu", "DBRX's act(w1 x) * v1 x experts"),
            "hidden_act_scaling_factor": (1.0, "DBRX's unscaled activation"),
            "hidden_act_bias": (0.0, "DBRX's act(w1 x) * v1 x experts"),
            "gate_clamp_upper_limit": unclamped,
            "gate_clamp_lower_limit": unclamped,
            "up_clamp_upper_limit": unclamped,
            "up_clamp_lower_limit": unclamped,
            "normalize_top_k_affinities": (
                normalize,
                f"moe_normalize_expert_weights={p} with moe_top_k={self.num_experts_per_tok}",
            ),
        }

    def get_required_attributes(self) -> list[str]:
        return [
            "hidden_size",
            "num_attention_heads",
            "num_hidden_layers",
            "vocab_size",
            "max_position_embeddings",
            "attn_config",
            "ffn_config",
        ]

    def validate_config(self) -> None:
        super().validate_config()
        problems = moe_neuron_config_problems(self.neuron_config, "DBRX", "DbrxNeuronConfig")
        if problems:
            raise ConfigError(problems)

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return DbrxNeuronConfig


class NeuronDbrxAttention(NeuronAttentionBase):
    """The attention building block with each of Q, K and V clamped to [-clip_qkv, clip_qkv]
    right after the projection, as DBRX's fused ``Wqkv`` output is."""

    def __init__(self, config: InferenceConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.clip_qkv = getattr(config, "clip_qkv", None)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project_qkv(x)
        if self.clip_qkv is None:
            return q, k, v
        clip = self.clip_qkv
        return q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip)


def layer_norm(dim: int) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=LAYER_NORM_EPS, bias=False)


class NeuronDbrxBlock(nn.Module):
    """x + attention(norm(x)), then h + ffn(norm(h))."""

    def __init__(self, config: InferenceConfig, layer_idx: int) -> None:
        super().__init__()
        _, act_over_top_k = top_k_weighting(
            config.moe_normalize_expert_weights, config.num_experts_per_tok
        )
        self.self_attn = NeuronDbrxAttention(config, layer_idx)
        self.ffn = initialize_moe_module(config, apply_act_fn_over_topk=act_over_top_k)
        self.input_layernorm = layer_norm(config.hidden_size)
        self.post_attention_layernorm = layer_norm(config.hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: CacheSlot,
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), rope, mask, cache)
        out = self.ffn(self.post_attention_layernorm(h))
        return h + without_router_outputs(out)


class NeuronDbrxModel(NeuronBaseModel):
    def init_model(self, config: InferenceConfig) -> None:
        tp = {"tp_degree": tp_world_size(), "rank": tp_rank()}
        self.embed_tokens = ParallelEmbedding(config.vocab_size, config.hidden_size, **tp)
        self.layers = nn.ModuleList(
            NeuronDbrxBlock(config, index) for index in range(config.num_hidden_layers)
        )
        self.norm = layer_norm(config.hidden_size)
        self.lm_head = ColumnParallelLinear(
            config.hidden_size, config.vocab_size, bias=False, gather_output=True, **tp
        )
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), rope_parameters(config))


class NeuronDbrxForCausalLM(NeuronBaseForCausalLM):
    _STATE_DICT_MODEL_PREFIX = "transformer."
    _model_cls = NeuronDbrxModel

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return DbrxInferenceConfig
