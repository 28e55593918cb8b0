"""Grouped-query attention: how K/V heads are replicated so that they shard over tp_degree.

Query head ``i`` of a model with ``q`` query heads and ``kv`` K/V heads attends to K/V head
``i // (q // kv)``. Both strategies of the feature guide replicate each K/V head ``r`` times,
contiguously, so new head ``j`` is old head ``j // r`` and query head ``i`` still reads its
original head through ``i // (q // (kv * r))``:

- ``REPLICATE_TO_TP_DEGREE`` (the default) gives every rank exactly the K/V heads its query
  heads need: ``max(kv, tp_degree)`` heads, which requires one of kv, tp_degree to divide the other.
- ``CONVERT_TO_MHA`` replicates up to one K/V head per query head; it costs more memory but
  works whenever the query heads shard.
"""

from __future__ import annotations

import enum

import torch

from nxdplug.errors import ConfigError


class GQA(enum.Enum):
    """K/V head sharding strategy (NxD Inference's ``GQA``)."""

    CONVERT_TO_MHA = "convert-to-mha"
    REPLICATE_TO_TP_DEGREE = "replicate-to-tp-degree"


def _replicates_to_tp(tp_degree: int, num_key_value_heads: int) -> bool:
    return tp_degree % num_key_value_heads == 0 or num_key_value_heads % tp_degree == 0


def determine_sharding_strategy(
    tp_degree: int, num_key_value_heads: int, desired: GQA = GQA.REPLICATE_TO_TP_DEGREE
) -> GQA:
    """``desired``, unless it is REPLICATE_TO_TP_DEGREE and the heads cannot be split that way.

    Replication needs tp_degree to be a multiple of the K/V heads (each head is copied) or the
    K/V heads to be a multiple of tp_degree (each rank gets whole heads); otherwise the K/V
    heads are converted to MHA, as NxD Inference does.
    """
    if desired is GQA.REPLICATE_TO_TP_DEGREE and not _replicates_to_tp(
        tp_degree, num_key_value_heads
    ):
        return GQA.CONVERT_TO_MHA
    return desired


def shardable_head_counts(
    tp_degree: int, num_attention_heads: int, num_key_value_heads: int, strategy: GQA
) -> tuple[int, int]:
    """(query heads, K/V heads) after applying ``strategy`` for ``tp_degree`` ranks.

    For example 32 query and 8 K/V heads give (32, 32) with tp_degree 32 under either strategy,
    and (32, 8) with tp_degree 4 under REPLICATE_TO_TP_DEGREE.
    """
    problems = []
    if min(tp_degree, num_attention_heads, num_key_value_heads) < 1:
        problems.append(
            f"tp_degree ({tp_degree}), num_attention_heads ({num_attention_heads}) and "
            f"num_key_value_heads ({num_key_value_heads}) must be positive"
        )
    else:
        if num_attention_heads % num_key_value_heads:
            problems.append(
                f"num_attention_heads ({num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({num_key_value_heads})"
            )
        if num_attention_heads % tp_degree:
            problems.append(
                f"num_attention_heads ({num_attention_heads}) is not divisible by "
                f"tp_degree ({tp_degree})"
            )
        if strategy is GQA.REPLICATE_TO_TP_DEGREE and not _replicates_to_tp(
            tp_degree, num_key_value_heads
        ):
            problems.append(
                f"{strategy.name} needs tp_degree ({tp_degree}) and num_key_value_heads "
                f"({num_key_value_heads}) to divide one another; use {GQA.CONVERT_TO_MHA.name} "
                "(determine_sharding_strategy picks it)"
            )
    if problems:
        raise ConfigError(problems)
    if strategy is GQA.CONVERT_TO_MHA:
        return num_attention_heads, num_attention_heads
    return num_attention_heads, max(num_key_value_heads, tp_degree)


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
