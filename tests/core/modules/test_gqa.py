from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nxdplug.config.head_sharding import GQA, determine_sharding_strategy, shardable_head_counts
from nxdplug.errors import ConfigError
from nxdplug.modules.gqa import HeadLayout, replicate_kv_heads


@st.composite
def head_layouts(draw: st.DrawFn) -> tuple[int, int, int]:
    """(tp_degree, query heads, K/V heads); the query heads need not divide by tp_degree."""
    num_kv = draw(st.integers(1, 8))
    num_q = num_kv * draw(st.integers(1, 4))
    tp = draw(st.integers(1, 2 * num_q))
    return tp, num_q, num_kv


def layout_of(tp: int, num_q: int, num_kv: int, desired: GQA = GQA.REPLICATE_TO_TP_DEGREE):
    return HeadLayout(num_q, num_kv, tp, determine_sharding_strategy(tp, num_kv, desired))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over heads ``[heads, seq, head_dim]``, K/V repeated to the query heads."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    mask = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def heads(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Project ``x [seq, hidden]`` and split into ``[heads, seq, head_dim]``."""
    return (x @ weight.T + bias).reshape(x.shape[0], -1, head_dim).transpose(0, 1)


def merged(per_head: torch.Tensor) -> torch.Tensor:
    """``[heads, seq, head_dim]`` -> ``[seq, heads * head_dim]``, o_proj's input."""
    return per_head.transpose(0, 1).reshape(per_head.shape[1], -1)


@settings(max_examples=80, deadline=None)
@given(head_layouts(), st.sampled_from(list(GQA)))
def test_every_query_head_keeps_its_kv_head_on_its_rank(
    layout: tuple[int, int, int], desired: GQA
) -> None:
    tp, num_q, num_kv = layout
    heads_of = layout_of(tp, num_q, num_kv, desired)
    new_q, new_kv = heads_of.head_counts

    assert new_q % tp == 0 and new_kv % tp == 0 and new_q % new_kv == 0
    assert num_q <= new_q < num_q + tp
    # Number the heads from 1 and lay the numbers out as one-value heads: padding shows as 0.
    query_ids = heads_of.query_heads(torch.arange(1, num_q + 1), head_dim=1)
    kv_ids = heads_of.kv_heads(torch.arange(1, num_kv + 1), head_dim=1)
    assert sorted(query_ids[query_ids > 0].tolist()) == list(range(1, num_q + 1))
    for new_head, query in enumerate(query_ids.tolist()):
        kv_head = new_head // (new_q // new_kv)
        if query:
            assert kv_ids[kv_head] == (query - 1) // (num_q // num_kv) + 1  # its own K/V head
        assert new_head // (new_q // tp) == kv_head // (new_kv // tp)  # on the same rank


@settings(max_examples=50, deadline=None)
@given(head_layouts(), st.integers(1, 3), st.integers(1, 5), st.sampled_from(list(GQA)))
def test_laid_out_attention_equals_gqa_attention_on_every_rank(
    layout: tuple[int, int, int], head_dim: int, seq: int, desired: GQA
) -> None:
    tp, num_q, num_kv = layout
    hidden = 6
    gen = torch.Generator().manual_seed(num_q * 100 + num_kv * 10 + tp)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.float64, generator=gen)

    x = rand(seq, hidden)
    wq, bq = rand(num_q * head_dim, hidden), rand(num_q * head_dim)
    wk, bk = rand(num_kv * head_dim, hidden), rand(num_kv * head_dim)
    wv, bv = rand(num_kv * head_dim, hidden), rand(num_kv * head_dim)
    wo = rand(hidden, num_q * head_dim)
    k, v = (heads(x, w, b, head_dim) for w, b in ((wk, bk), (wv, bv)))
    expected = merged(attention(heads(x, wq, bq, head_dim), k, v)) @ wo.T

    heads_of = layout_of(tp, num_q, num_kv, desired)
    new_q, new_kv = heads_of.head_counts
    q = heads(x, heads_of.query_heads(wq, head_dim), heads_of.query_heads(bq, head_dim), head_dim)
    k, v = (
        heads(x, heads_of.kv_heads(w, head_dim), heads_of.kv_heads(b, head_dim), head_dim)
        for w, b in ((wk, bk), (wv, bv))
    )
    wo = heads_of.query_heads(wo, head_dim, dim=1)

    torch.testing.assert_close(merged(attention(q, k, v)) @ wo.T, expected, rtol=1e-12, atol=1e-12)
    # Each rank, with only its slice of the query and K/V heads and its columns of o_proj,
    # computes a partial output; their sum (the all-reduce) is the model's.
    q_per_rank, kv_per_rank = new_q // tp, new_kv // tp
    partial_sums = [
        merged(
            attention(
                q[r * q_per_rank : (r + 1) * q_per_rank],
                k[r * kv_per_rank : (r + 1) * kv_per_rank],
                v[r * kv_per_rank : (r + 1) * kv_per_rank],
            )
        )
        @ wo[:, r * q_per_rank * head_dim : (r + 1) * q_per_rank * head_dim].T
        for r in range(tp)
    ]
    torch.testing.assert_close(sum(partial_sums), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("tp", "num_q", "num_kv", "strategy", "counts"),
    [
        (32, 64, 8, GQA.REPLICATE_TO_TP_DEGREE, (64, 32)),  # the guide: 8 K/V heads -> 32
        (4, 64, 8, GQA.REPLICATE_TO_TP_DEGREE, (64, 8)),  # already whole heads per rank
        (8, 32, 8, GQA.REPLICATE_TO_TP_DEGREE, (32, 8)),
        (2, 32, 1, GQA.REPLICATE_TO_TP_DEGREE, (32, 2)),  # multi-query attention
        (8, 32, 32, GQA.REPLICATE_TO_TP_DEGREE, (32, 32)),  # MHA stays MHA
        (6, 24, 4, GQA.CONVERT_TO_MHA, (24, 24)),  # neither divides the other: fall back
        (12, 24, 8, GQA.CONVERT_TO_MHA, (24, 24)),
        (32, 56, 8, GQA.REPLICATE_TO_TP_DEGREE, (64, 32)),  # query heads padded 56 -> 64
        (32, 56, 56, GQA.CONVERT_TO_MHA, (64, 64)),  # MHA: both padded
        (3, 32, 8, GQA.CONVERT_TO_MHA, (33, 33)),
    ],
)
def test_strategy_table(
    tp: int, num_q: int, num_kv: int, strategy: GQA, counts: tuple[int, int]
) -> None:
    assert determine_sharding_strategy(tp, num_kv) is strategy
    assert shardable_head_counts(tp, num_q, num_kv, strategy) == counts


def test_padding_goes_to_the_end_of_each_kv_group_under_replication() -> None:
    # 6 query heads in 2 groups of 3 (one per K/V head), tp 4: each group grows to 4 heads.
    heads_of = layout_of(4, 6, 2)

    padded = heads_of.query_heads(torch.arange(1, 7), head_dim=1)

    assert padded.tolist() == [1, 2, 3, 0, 4, 5, 6, 0]
    assert heads_of.kv_heads(torch.arange(1, 3), head_dim=1).tolist() == [1, 1, 2, 2]


def test_convert_to_mha_when_asked() -> None:
    strategy = determine_sharding_strategy(32, 8, GQA.CONVERT_TO_MHA)

    assert strategy is GQA.CONVERT_TO_MHA
    assert shardable_head_counts(32, 64, 8, strategy) == (64, 64)


@pytest.mark.parametrize(
    ("tp", "num_q", "num_kv", "strategy", "message"),
    [
        (6, 24, 4, GQA.REPLICATE_TO_TP_DEGREE, "CONVERT_TO_MHA"),
        (2, 12, 8, GQA.REPLICATE_TO_TP_DEGREE, "not a multiple of num_key_value_heads"),
        (0, 8, 8, GQA.CONVERT_TO_MHA, "must be positive"),
    ],
)
def test_head_counts_that_do_not_shard(
    tp: int, num_q: int, num_kv: int, strategy: GQA, message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        shardable_head_counts(tp, num_q, num_kv, strategy)


@pytest.mark.parametrize("with_hidden_dim", [True, False])
def test_replicate_kv_heads_repeats_each_head_contiguously(with_hidden_dim: bool) -> None:
    head_dim, hidden = 3, 5
    # Every row of head h holds h, so the result shows which old head each new head is.
    head_ids = torch.arange(2).repeat_interleave(head_dim)
    tensor = head_ids[:, None].expand(-1, hidden).clone() if with_hidden_dim else head_ids

    replicated = replicate_kv_heads(tensor, num_kv_heads=2, target_kv_heads=6, head_dim=head_dim)

    assert replicated.shape == ((6 * head_dim, hidden) if with_hidden_dim else (6 * head_dim,))
    new_head_of_row = replicated[:, 0] if with_hidden_dim else replicated
    expected = torch.tensor([0, 0, 0, 1, 1, 1]).repeat_interleave(head_dim)
    assert torch.equal(new_head_of_row, expected)


def test_replicate_kv_heads_rejects_bad_targets_and_shapes() -> None:
    with pytest.raises(ConfigError, match="not a multiple"):
        replicate_kv_heads(torch.zeros(8, 4), num_kv_heads=2, target_kv_heads=3, head_dim=4)
    with pytest.raises(ConfigError, match="got shape"):
        replicate_kv_heads(torch.zeros(9, 4), num_kv_heads=2, target_kv_heads=4, head_dim=4)
