"""How many query and K/V heads a model has once sharded over tp_degree (NxD Inference's
``GQA`` strategies and head counts): plain arithmetic on the config, so that validation can
check a config before any module exists (:mod:`nxdplug.modules.gqa` lays the weights out)."""

from __future__ import annotations

import enum

from nxdplug.errors import ConfigError


class GQA(enum.Enum):
    """K/V head sharding strategy (NxD Inference's ``GQA``)."""

    CONVERT_TO_MHA = "convert-to-mha"
    REPLICATE_TO_TP_DEGREE = "replicate-to-tp-degree"


def _replicates_to_tp(tp_degree: int, num_key_value_heads: int) -> bool:
    return tp_degree % num_key_value_heads == 0 or num_key_value_heads % tp_degree == 0


def determine_sharding_strategy(
    tp_degree: int,
    source_key_value_heads: int,
    desired_sharding_strategy: GQA | None = None,
) -> GQA:
    """The desired strategy (REPLICATE_TO_TP_DEGREE by default), unless that is replication
    and the heads cannot be split that way. (NxD Inference's names and defaults.)

    Replication needs tp_degree to be a multiple of the K/V heads (each head is copied) or the
    K/V heads to be a multiple of tp_degree (each rank gets whole heads); otherwise the K/V
    heads are converted to MHA, as NxD Inference does.
    """
    desired = desired_sharding_strategy or GQA.REPLICATE_TO_TP_DEGREE
    if desired is GQA.REPLICATE_TO_TP_DEGREE and not _replicates_to_tp(
        tp_degree, source_key_value_heads
    ):
        return GQA.CONVERT_TO_MHA
    return desired


def padded_head_count(num_heads: int, tp_degree: int) -> int:
    """``num_heads`` rounded up to a multiple of ``tp_degree``."""
    return -(-num_heads // tp_degree) * tp_degree


def shardable_head_counts(
    tp_degree: int, num_attention_heads: int, num_key_value_heads: int, sharding_strategy: GQA
) -> tuple[int, int]:
    """(query heads, K/V heads) after applying ``sharding_strategy`` for ``tp_degree`` ranks.

    For example 32 query and 8 K/V heads give (32, 32) with tp_degree 32 under either strategy,
    and (32, 8) with tp_degree 4 under REPLICATE_TO_TP_DEGREE; 56 query and 8 K/V heads give
    (64, 32) with tp_degree 32 (padded query heads).
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
        if sharding_strategy is GQA.REPLICATE_TO_TP_DEGREE and not _replicates_to_tp(
            tp_degree, num_key_value_heads
        ):
            problems.append(
                f"{sharding_strategy.name} needs tp_degree ({tp_degree}) and num_key_value_heads "
                f"({num_key_value_heads}) to divide one another; use {GQA.CONVERT_TO_MHA.name} "
                "(determine_sharding_strategy picks it)"
            )
    if problems:
        raise ConfigError(problems)
    query_heads = padded_head_count(num_attention_heads, tp_degree)
    if sharding_strategy is GQA.CONVERT_TO_MHA:
        return query_heads, query_heads
    return query_heads, max(num_key_value_heads, tp_degree)
