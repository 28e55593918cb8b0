"""Grouped-query attention: how query and K/V heads are laid out so that they shard over
tp_degree.

Query head ``i`` of a model with ``q`` query heads and ``kv`` K/V heads attends to K/V head
``i // (q // kv)``. Both strategies of the feature guide replicate each K/V head ``r`` times,
contiguously, so new head ``j`` is old head ``j // r`` and query head ``i`` still reads its
original head through ``i // (q // (kv * r))``:

- ``REPLICATE_TO_TP_DEGREE`` (the default) gives every rank exactly the K/V heads its query
  heads need: ``max(kv, tp_degree)`` heads, which requires one of kv, tp_degree to divide the other.
- ``CONVERT_TO_MHA`` replicates up to one K/V head per query head; it costs more memory but
  works whenever the query heads shard.

Query heads that do not divide by tp_degree are padded with zero heads up to the next multiple,
as NxD Inference pads them (56 heads at tp_degree 32 -> 64). A zero query head attends evenly to
zero values and its output columns of ``o_proj`` are zero, so it adds nothing. Under
REPLICATE_TO_TP_DEGREE the padding goes to the end of each K/V head's group of query heads
(interleaved), so that every query head keeps its K/V head; under CONVERT_TO_MHA the query and
the K/V heads are padded at the end alike.
"""

from __future__ import annotations

import attrs
import torch

from nxdplug.config.head_sharding import GQA, shardable_head_counts
from nxdplug.errors import ConfigError


def pad_heads(
    tensor: torch.Tensor, num_heads: int, target_heads: int, groups: int, head_dim: int, dim: int
) -> torch.Tensor:
    """``tensor`` with zero heads added at the end of each of ``groups`` equal groups of heads
    along ``dim`` (``num_heads * head_dim`` long), giving ``target_heads`` heads."""
    if target_heads == num_heads:
        return tensor
    moved = tensor.movedim(dim, 0)
    rest = moved.shape[1:]
    grouped = moved.reshape(groups, num_heads // groups, head_dim, *rest)
    padded = grouped.new_zeros(groups, target_heads // groups, head_dim, *rest)
    padded[:, : num_heads // groups] = grouped
    return padded.reshape(target_heads * head_dim, *rest).movedim(0, dim)


@attrs.frozen
class HeadLayout:
    """A checkpoint's attention heads and their layout over ``tp_degree`` ranks: the counts a
    model builds, and how each projection's checkpoint tensors are rearranged to them."""

    num_attention_heads: int
    num_key_value_heads: int
    tp_degree: int
    strategy: GQA

    @property
    def head_counts(self) -> tuple[int, int]:
        """(query heads, K/V heads) of the model."""
        return shardable_head_counts(
            self.tp_degree, self.num_attention_heads, self.num_key_value_heads, self.strategy
        )

    @property
    def is_padded(self) -> bool:
        return self.head_counts[0] != self.num_attention_heads

    def query_heads(self, tensor: torch.Tensor, head_dim: int, dim: int = 0) -> torch.Tensor:
        """A tensor over the query heads along ``dim`` (q_proj rows, its bias and scales, o_proj
        columns with ``dim=1``, one value per head with ``head_dim=1``), padded to the layout."""
        groups = 1 if self.strategy is GQA.CONVERT_TO_MHA else self.num_key_value_heads
        target = self.head_counts[0]
        return pad_heads(tensor, self.num_attention_heads, target, groups, head_dim, dim)

    def kv_heads(self, tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
        """k_proj/v_proj rows (weight ``[kv * head_dim, hidden]``, bias, scales) replicated,
        and under CONVERT_TO_MHA padded like the query heads."""
        target = self.head_counts[1]
        if self.strategy is GQA.REPLICATE_TO_TP_DEGREE:
            return replicate_kv_heads(tensor, self.num_key_value_heads, target, head_dim)
        replicated = replicate_kv_heads(
            tensor, self.num_key_value_heads, self.num_attention_heads, head_dim
        )
        return pad_heads(replicated, self.num_attention_heads, target, 1, head_dim, 0)


def replicate_kv_heads(
    weight_or_bias: torch.Tensor, num_kv_heads: int, target_kv_heads: int, head_dim: int
) -> torch.Tensor:
    """Repeat each K/V head of a k/v projection weight ``[kv * head_dim, hidden]`` (or bias
    ``[kv * head_dim]``) contiguously, giving ``target_kv_heads`` heads: new head ``j`` is old
    head ``j // (target_kv_heads // num_kv_heads)``.
    """
    if target_kv_heads % num_kv_heads:
        raise ConfigError(
            [
                f"target_kv_heads ({target_kv_heads}) is not a multiple of "
                f"num_kv_heads ({num_kv_heads})"
            ]
        )
    if weight_or_bias.shape[0] != num_kv_heads * head_dim:
        raise ConfigError(
            [
                f"a k/v projection with {num_kv_heads} heads of size {head_dim} has "
                f"{num_kv_heads * head_dim} rows; got shape {list(weight_or_bias.shape)}"
            ]
        )
    heads = weight_or_bias.reshape(num_kv_heads, head_dim, *weight_or_bias.shape[1:])
    repeated = heads.repeat_interleave(target_kv_heads // num_kv_heads, dim=0)
    return repeated.reshape(target_kv_heads * head_dim, *weight_or_bias.shape[1:])
