from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nxdplug.errors import ConfigError
from nxdplug.modules.gqa import (
    GQA,
    determine_sharding_strategy,
    replicate_kv_heads,
    shardable_head_counts,
)


@st.composite
def head_layouts(draw: st.DrawFn) -> tuple[int, int, int]:
    """(tp_degree, query heads, K/V heads) with the query heads divisible by tp_degree."""
    num_kv = draw(st.integers(1, 8))
    num_q = num_kv * draw(st.integers(1, 4))
    tp = draw(st.sampled_from([d for d in range(1, num_q + 1) if num_q % d == 0]))
    return tp, num_q, num_kv


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


@settings(max_examples=60, deadline=None)
@given(head_layouts())
def test_every_query_head_keeps_its_kv_head_on_its_rank(layout: tuple[int, int, int]) -> None:
    tp, num_q, num_kv = layout
    strategy = determine_sharding_strategy(tp, num_kv)

    new_q, new_kv = shardable_head_counts(tp, num_q, num_kv, strategy)

    assert new_q == num_q
    assert new_kv % tp == 0 and new_kv % num_kv == 0 and num_q % new_kv == 0
    copies = new_kv // num_kv
    for i in range(num_q):
        new_head = i // (num_q // new_kv)
        assert new_head // copies == i // (num_q // num_kv)  # the same original K/V head
        assert new_head // (new_kv // tp) == i // (num_q // tp)  # on the query head's rank


@settings(max_examples=40, deadline=None)
@given(head_layouts(), st.integers(1, 3), st.integers(1, 5), st.sampled_from(list(GQA)))
def test_replicated_attention_equals_gqa_attention(
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
    q = heads(x, wq, bq, head_dim)
    expected = attention(q, heads(x, wk, bk, head_dim), heads(x, wv, bv, head_dim))

    strategy = determine_sharding_strategy(tp, num_kv, desired)
    _, new_kv = shardable_head_counts(tp, num_q, num_kv, strategy)
    k, v = (
        heads(
            x,
            replicate_kv_heads(w, num_kv, new_kv, head_dim),
            replicate_kv_heads(b, num_kv, new_kv, head_dim),
            head_dim,
        )
        for w, b in ((wk, bk), (wv, bv))
    )

    torch.testing.assert_close(attention(q, k, v), expected, rtol=1e-12, atol=1e-12)
    # Each rank, with only its slice of the query and K/V heads, computes its heads exactly.
    q_per_rank, kv_per_rank = num_q // tp, new_kv // tp
    per_rank = [
        attention(
            q[r * q_per_rank : (r + 1) * q_per_rank],
            k[r * kv_per_rank : (r + 1) * kv_per_rank],
            v[r * kv_per_rank : (r + 1) * kv_per_rank],
        )
        for r in range(tp)
    ]
    torch.testing.assert_close(torch.cat(per_rank), expected, rtol=1e-12, atol=1e-12)


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
    ],
)
def test_strategy_table(
    tp: int, num_q: int, num_kv: int, strategy: GQA, counts: tuple[int, int]
) -> None:
    assert determine_sharding_strategy(tp, num_kv) is strategy
    assert shardable_head_counts(tp, num_q, num_kv, strategy) == counts


def test_convert_to_mha_when_asked() -> None:
    strategy = determine_sharding_strategy(32, 8, GQA.CONVERT_TO_MHA)

    assert strategy is GQA.CONVERT_TO_MHA
    assert shardable_head_counts(32, 64, 8, strategy) == (64, 64)


@pytest.mark.parametrize(
    ("tp", "num_q", "num_kv", "strategy", "message"),
    [
        (3, 32, 8, GQA.CONVERT_TO_MHA, "num_attention_heads (32) is not divisible by tp_degree"),
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
