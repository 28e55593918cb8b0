"""Bucket lists: NxD Inference's ``generate_buckets`` and its per-sub-model bucket functions."""

from __future__ import annotations

import pytest

from nxdplug.config import InferenceConfig, NeuronConfig
from nxdplug.config.buckets import (
    generate_buckets,
    generate_buckets_for_cte,
    generate_buckets_for_fused_spec,
    generate_buckets_for_speculation,
    generate_buckets_for_tkg,
)
from nxdplug.config.validation import core_config_problems

# Expected values worked out by hand from NxD Inference's algorithm
# (modules/autobucketing.py): 2**k for k in [floor(log2(min)), round(log2(max))), then max;
# just [max] when min == max.
NXDI_BUCKETS = [
    (128, 128, [128]),
    (128, 100, [100]),
    (128, 1, [1]),
    (512, 128, [128]),
    (1000, 1000, [1000]),
    (128, 129, [129]),  # log2(129) rounds down to 7: no bucket below the maximum
    (128, 181, [181]),  # log2(181) = 7.4998...
    (128, 182, [128, 182]),  # log2(182) = 7.507...
    (128, 256, [128, 256]),
    (128, 300, [128, 300]),
    (128, 700, [128, 256, 700]),  # 512 is left out: log2(700) rounds to 9
    (128, 768, [128, 256, 512, 768]),
    (128, 1000, [128, 256, 512, 1000]),
    (128, 1024, [128, 256, 512, 1024]),
    (128, 3000, [128, 256, 512, 1024, 2048, 3000]),
    (128, 4096, [128, 256, 512, 1024, 2048, 4096]),
    (128, 5000, [128, 256, 512, 1024, 2048, 5000]),
    (64, 300, [64, 128, 300]),
    (100, 1000, [64, 128, 256, 512, 1000]),  # the minimum rounds down to a power of two
    (1, 8, [1, 2, 4, 8]),
]


@pytest.mark.parametrize(("min_length", "max_length", "expected"), NXDI_BUCKETS)
def test_generate_buckets_gives_nxdi_buckets(
    min_length: int, max_length: int, expected: list[int]
) -> None:
    assert generate_buckets(min_length, max_length) == expected


@pytest.mark.parametrize(("min_length", "max_length"), [(128, 0), (0, 128), (-1, 4)])
def test_generate_buckets_rejects_non_positive_lengths(min_length: int, max_length: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        generate_buckets(min_length, max_length)


def test_neuron_config_default_buckets_are_nxdi_ones() -> None:
    config = NeuronConfig(enable_bucketing=True, seq_len=1000, max_context_length=300)
    assert config.context_encoding_buckets == [128, 300]
    assert config.token_generation_buckets == [128, 256, 512, 1000]


def test_token_generation_buckets_go_up_to_max_length() -> None:
    config = NeuronConfig(
        enable_bucketing=True, seq_len=4096, max_length=3000, max_context_length=768
    )
    assert config.context_encoding_buckets == [128, 256, 512, 768]
    assert config.token_generation_buckets == [128, 256, 512, 1024, 2048, 3000]
    assert not core_config_problems(InferenceConfig(config))


def test_sub_model_functions_with_bucketing() -> None:
    config = InferenceConfig(
        NeuronConfig(enable_bucketing=True, seq_len=700, max_context_length=182)
    )
    assert generate_buckets_for_cte(config) == [128, 182]
    for function in (
        generate_buckets_for_tkg,
        generate_buckets_for_speculation,
        generate_buckets_for_fused_spec,
    ):
        assert function(config) == [128, 256, 700]


def test_sub_model_functions_keep_given_buckets() -> None:
    config = InferenceConfig(
        NeuronConfig(
            enable_bucketing=True,
            seq_len=4096,
            context_encoding_buckets=[256, 1024],
            token_generation_buckets=[2048, 4096],
        )
    )
    assert generate_buckets_for_cte(config) == [256, 1024]
    assert generate_buckets_for_tkg(config) == [2048, 4096]


def test_sub_model_functions_without_bucketing() -> None:
    config = InferenceConfig(NeuronConfig(seq_len=1000, max_context_length=300))
    assert generate_buckets_for_cte(config) == [300]
    assert generate_buckets_for_tkg(config) == [1000]
    assert generate_buckets_for_speculation(config.neuron_config) == [1000]


def test_token_generation_batches_give_batch_and_length_pairs() -> None:
    """NxD Inference's batch bucketing: [batch, seq] pairs, largest batch first, the token
    generation batch size always among them; speculation keeps plain lengths."""
    neuron_config = NeuronConfig(
        batch_size=8,
        seq_len=512,
        enable_bucketing=True,
        token_generation_buckets=[256, 512],
        token_generation_batches=[4, 1],
    )
    assert neuron_config.token_generation_batches == [1, 4]
    config = InferenceConfig(neuron_config)
    assert generate_buckets_for_tkg(config) == [
        [8, 256], [8, 512], [4, 256], [4, 512], [1, 256], [1, 512],
    ]  # fmt: skip
    assert generate_buckets_for_speculation(config) == [256, 512]
    assert generate_buckets_for_tkg(
        InferenceConfig(NeuronConfig(seq_len=64, token_generation_batches=1))
    ) == [[1, 64]]


def test_token_generation_batches_are_checked_and_refused_at_build() -> None:
    with pytest.raises(AssertionError, match=r"should be <= token generation batch size \(2\)"):
        NeuronConfig(batch_size=2, token_generation_batches=[1, 4])
    problems = core_config_problems(
        InferenceConfig(
            NeuronConfig(batch_size=4, token_generation_batches=[2]), num_attention_heads=4
        )
    )
    assert any(
        "token_generation_batches=[2] (batch bucketing) is not implemented" in p for p in problems
    )
