"""Multi-head attention with grouped K/V heads, rotary positions and a KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from nxdplug.config.head_sharding import determine_sharding_strategy
from nxdplug.modules.gqa import HeadLayout
from nxdplug.modules.kv_cache import CacheSlot
from nxdplug.modules.norms import RMSNorm
from nxdplug.modules.parallel_linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    tp_rank,
    tp_world_size,
)
from nxdplug.modules.rotary import apply_rotary
from nxdplug.modules.step import encoding_prompts

if TYPE_CHECKING:
    from nxdplug.config import InferenceConfig


def head_dim_of(config: InferenceConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def head_layout(config: InferenceConfig) -> HeadLayout:
    """The model's attention heads laid out for the configured tp_degree (GQA strategy chosen
    as NxD Inference chooses it, query heads padded to a multiple of tp_degree)."""
    tp_degree = config.neuron_config.tp_degree
    return HeadLayout(
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        tp_degree=tp_degree,
        strategy=determine_sharding_strategy(tp_degree, config.num_key_value_heads),
    )


def attention_head_counts(config: InferenceConfig) -> tuple[int, int]:
    """(query heads, K/V heads) the model builds: padded and replicated for tp_degree."""
    return head_layout(config).head_counts


def repeat_kv(x: torch.Tensor, times: int) -> torch.Tensor:
    """[batch, kv_heads, seq, dim] -> [batch, kv_heads * times, seq, dim], each head repeated."""
    if times == 1:
        return x
    return x.repeat_interleave(times, dim=1)


# Up to this many queries per step (token generation, speculation), attention is written out as
# two batched matmuls around a softmax. PyTorch's fused CPU attention kernel costs ~0.2 ms a call
# whatever the size, a third of a compiled decode step; it stays for prompts, where it also
# avoids materializing the [queries, keys] scores.
MAX_QUERIES_WRITTEN_OUT = 64


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[batch, heads, seq, head_dim] -> [batch, seq, heads * head_dim]."""
    batch, _, seq, _ = x.shape
    return x.transpose(1, 2).reshape(batch, seq, -1)


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d), masked) v, each K/V head serving its group of query heads.

    q: [batch, heads, queries, dim]; k, v: [batch, kv_heads, keys, dim]; mask: boolean
    [batch, 1, queries, keys]. Query head h uses K/V head h // (heads // kv_heads), as with
    ``repeat_kv``, but K and V are read in place rather than copied per query head. The scores
    and the softmax are float32, as in PyTorch's fused CPU kernel that HF transformers' bf16
    attention runs (scores rounded to bf16 first put nxdplug's bf16 logits up to 1.27x further
    from float32 than HF's own bf16). As there, the unnormalized exp(score - max) is rounded to
    v's dtype, weighs the values in float32 and the sums are divided by the exps' float32 total
    (probabilities rounded after normalizing differ from HF's bf16 attention output in 40% of
    its elements and gave a heavier tail of logit errors); a query that may see no key gets a
    uniform (finite) mix rather than NaN.
    """
    batch, heads, queries, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    q = q.reshape(batch, kv_heads, groups * queries, dim)
    scores = (q.float() @ k.float().transpose(-1, -2)) * dim**-0.5
    scores = scores.view(batch, kv_heads, groups, queries, keys)
    scores = scores.masked_fill(~mask[:, :, None], torch.finfo(torch.float32).min)
    exps = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    total = exps.sum(dim=-1, keepdim=True)
    exps = exps.to(v.dtype).float().view(batch, kv_heads, groups * queries, keys)
    out = (exps @ v.float()).view(batch, kv_heads, groups, queries, dim) / total
    return out.to(v.dtype).view(batch, heads, queries, dim)


def attention_mask_4d(
    key_mask: torch.Tensor, position_ids: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Boolean [batch, 1, queries, keys] mask: a query at position p sees valid keys at
    positions <= p (and > p - sliding_window). Key k sits at cache position k."""
    key_positions = torch.arange(key_mask.shape[-1], device=key_mask.device)
    query_positions = position_ids[:, :, None]
    allowed = (key_positions <= query_positions) & key_mask[:, None, :].bool()
    if sliding_window is not None:
        allowed = allowed & (key_positions > query_positions - sliding_window)
    return allowed[:, None, :, :]


def qk_norms(config: InferenceConfig, head_dim: int, enabled: bool) -> tuple[nn.Module, nn.Module]:
    """The per-head query and key norms: RMSNorms over ``head_dim`` (eps ``rms_norm_eps``, HF's
    1e-6 when the config has none), or identities when QK layer normalization is off."""
    if not enabled:
        return nn.Identity(), nn.Identity()
    eps = getattr(config, "rms_norm_eps", 1e-6)
    return RMSNorm(head_dim, eps=eps), RMSNorm(head_dim, eps=eps)


class CacheAttention(Protocol):
    """How a step's keys and values reach the KV cache and its queries attend over the cached
    ones: ``(attention, q, k, v, mask, cache) -> [batch, heads, queries, head_dim]``.

    By default (:func:`attend_over_local_cache`) each rank caches every position of its K/V
    heads; a plugin that lays the cache out otherwise (positions split over ranks) claims an
    attention module's ``cache_attention`` slot (:func:`nxdplug.slots.claim_slot`) in its
    ``transform_model``; a second plugin claiming it is refused.
    """

    def __call__(
        self,
        attention: NeuronAttentionBase,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        cache: CacheSlot,
    ) -> torch.Tensor: ...


def attend_over_local_cache(
    attention: NeuronAttentionBase,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    cache: CacheSlot,
) -> torch.Tensor:
    """Store this step's keys and values, then attend over the cache's first positions: where
    the cache's manager computes the plain softmax attention over its own layout (a kernel of
    its KV-cache plugin) and the layer's attention is that, the manager's way."""
    if attention.attends_by_plain_softmax:
        attended = cache.store_and_attend(q.to(attention.attention_dtype or q.dtype), k, v, mask)
        if attended is not None:
            return attended
    k, v = cache.store_and_fetch(k, v)
    return attention.attend(q, k, v, mask)


class NeuronAttentionBase(nn.Module):
    """Q/K/V projections (fused or not), rotary, cache update, softmax(QK^T/sqrt(d))V, output.

    The rotary table decides how many dims of each head turn (all of them, or the first ones
    for partial rotary); ``qkv_bias`` / ``o_bias`` add biases to the projections.
    ``qk_layernorm`` (the argument, or ``neuron_config.qk_layernorm``) normalizes each query and
    key head with an RMSNorm over ``head_dim`` before rotary, as Qwen3 does; the weights
    (``q_norm.weight``, ``k_norm.weight``) are shared by all heads, so a rank normalizes its own
    heads and replicated K/V heads need nothing more. ``cache_attention`` (see
    :class:`CacheAttention`) stores the step's keys and values and attends over the cache.
    ``input_size`` is the width the projections read when it is not ``hidden_size`` (a draft
    layer that reads a token's embedding beside a feature).
    """

    def __init__(
        self,
        config: InferenceConfig,
        layer_idx: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        sliding_window: int | None = None,
        qk_layernorm: bool = False,
        input_size: int | None = None,
    ) -> None:
        super().__init__()
        neuron_config = config.neuron_config
        self.layer_idx = layer_idx
        self.head_dim = head_dim_of(config)
        num_heads, num_kv_heads = attention_head_counts(config)
        world = tp_world_size()
        self.num_heads = num_heads // world
        self.num_kv_heads = num_kv_heads // world
        self.fused_qkv = bool(neuron_config.fused_qkv)
        tp = {"tp_degree": world, "rank": tp_rank()}
        hidden = config.hidden_size
        inputs = input_size or hidden
        q_size, kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        if self.fused_qkv:
            self.qkv_proj = ColumnParallelLinear(
                inputs,
                q_size + 2 * kv_size,
                bias=qkv_bias,
                partitions=(q_size, kv_size, kv_size),
                **tp,
            )
        else:
            self.q_proj = ColumnParallelLinear(inputs, q_size, bias=qkv_bias, **tp)
            self.k_proj = ColumnParallelLinear(inputs, kv_size, bias=qkv_bias, **tp)
            self.v_proj = ColumnParallelLinear(inputs, kv_size, bias=qkv_bias, **tp)
        self.o_proj = RowParallelLinear(
            q_size, hidden, bias=o_bias, reduce_dtype=neuron_config.rpl_reduce_dtype, **tp
        )
        self.q_norm, self.k_norm = qk_norms(
            config, self.head_dim, qk_layernorm or bool(neuron_config.qk_layernorm)
        )
        self.sliding_window = sliding_window
        self.attention_dtype = neuron_config.attention_dtype
        self.cache_attention: CacheAttention = attend_over_local_cache

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.fused_qkv:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        return self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)

    def split_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[batch, seq, heads * head_dim] -> [batch, heads, seq, head_dim] for each of q, k
        and v, each query and key head normalized (``q_norm``, ``k_norm``: identities unless QK
        layer normalization is on)."""
        batch, seq, _ = q.shape
        q = self.q_norm(q.view(batch, seq, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(batch, seq, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: CacheSlot,
    ) -> torch.Tensor:
        q, k, v = self.split_heads(*self.project_qkv(x))
        q, k = apply_rotary(q, k, *rope)
        out = self.cache_attention(self, q, k, v, mask, cache)  # writes k, v; reads the cache
        return self.o_proj(merge_heads(out.to(x.dtype)))

    @property
    def attends_by_plain_softmax(self) -> bool:
        """Whether :meth:`attend` is this class's masked softmax, which a KV cache may compute
        over its own layout instead; False for a model that weighs keys otherwise."""
        return type(self).attend is NeuronAttentionBase.attend

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(d), masked) v: q [batch, heads, queries, dim] over the cached
        k, v [batch, kv_heads, keys, dim]. A model whose attention weighs keys otherwise
        (learned sinks) overrides this step only."""
        dtype = self.attention_dtype or q.dtype
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if q.shape[2] <= MAX_QUERIES_WRITTEN_OUT:
            return grouped_attention(q, k, v, mask)
        if encoding_prompts() and self.sliding_window is None and q.shape[2] == k.shape[2]:
            # Prompts from position 0 over keys written in this call: for every real token the
            # mask is the causal one (padding sits after it), which the fused kernel then skips
            # block by block instead of computing and masking (half the work; the same values).
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        groups = self.num_heads // self.num_kv_heads
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
