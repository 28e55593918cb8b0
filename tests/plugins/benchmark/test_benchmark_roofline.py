"""The compute ceiling of prefill: FLOP counts against independent counts, the GEMM peak's shape.

Nothing here asserts on a speed: the machine running the tests is shared and noisy.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from nxdplug import from_pretrained
from nxdplug.plugins.benchmark.measurements import weights_skeleton
from nxdplug.plugins.benchmark.roofline import (
    PrefillCeiling,
    PrefillFlops,
    causal_attention_flops,
    matmul_parameters_per_token,
    measure_gemm_flops,
    prefill_flops,
)

BATCH, PROMPT = 2, 6


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    return path, from_pretrained(path)


def test_matmul_parameters_are_the_projections_of_every_layer(llama) -> None:
    _, model = llama
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    attention = 2 * c.hidden_size * c.num_attention_heads * head_dim  # q and o
    attention += 2 * c.hidden_size * c.num_key_value_heads * head_dim  # k and v
    mlp = 3 * c.hidden_size * c.intermediate_size  # gate, up, down
    per_token = c.num_hidden_layers * (attention + mlp)  # no embedding, no LM head
    assert matmul_parameters_per_token(weights_skeleton(model)) == per_token


def test_causal_attention_counts_each_query_against_the_keys_before_it(llama) -> None:
    _, model = llama
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    by_hand = 0
    for _row in range(BATCH):
        for _layer in range(c.num_hidden_layers):
            for _head in range(c.num_attention_heads):
                for query in range(PROMPT):
                    keys = query + 1
                    by_hand += 2 * head_dim * keys  # a score per key
                    by_hand += 2 * head_dim * keys  # a weighted sum of as many values
    assert causal_attention_flops(c, BATCH, PROMPT) == by_hand


def test_prefill_flops_match_hf_forward_counted_by_torch(llama) -> None:
    """HF's forward with eager attention, logits of the last token only, under torch's FLOP
    counter: its matmuls are the count's weights and LM head, plus attention over the full
    square of positions (eager attention masks the upper triangle after computing it)."""
    path, model = llama
    c = model.config
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ids = torch.randint(
        1, c.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0)
    )
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        hf(input_ids=ids, logits_to_keep=1, use_cache=False)
    head_dim = c.hidden_size // c.num_attention_heads
    square_attention = 2 * 2 * BATCH * c.num_hidden_layers * c.num_attention_heads
    square_attention *= PROMPT * PROMPT * head_dim
    flops = prefill_flops(weights_skeleton(model), c, BATCH, PROMPT)
    assert flops.lm_head == 2 * BATCH * c.hidden_size * c.vocab_size
    assert flops.weights + flops.lm_head == counter.get_total_flops() - square_attention
    assert flops.total == flops.weights + flops.attention + flops.lm_head


def test_routed_experts_count_the_experts_a_token_goes_to(tiny_checkpoint) -> None:
    path = tiny_checkpoint("mixtral", num_local_experts=4, num_experts_per_tok=2)
    model = from_pretrained(path)
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    attention = 2 * c.hidden_size * (c.num_attention_heads + c.num_key_value_heads) * head_dim
    router = c.hidden_size * 4
    experts = 2 * 3 * c.hidden_size * c.intermediate_size  # top 2 of 4, gate, up and down
    per_token = c.num_hidden_layers * (attention + router + experts)
    assert matmul_parameters_per_token(weights_skeleton(model)) == per_token


def test_gemm_peak_is_positive_and_finite() -> None:
    flops = measure_gemm_flops(torch.bfloat16, size=64, repeats=2)
    assert flops > 0 and math.isfinite(flops)


def test_prefill_ceiling_fractions_are_floor_over_ttft() -> None:
    ceiling = PrefillCeiling(
        gemm_flops_per_s=1e9, flops=PrefillFlops(weights=6_000_000, attention=3_000_000, lm_head=1)
    )
    assert ceiling.ttft_floor == pytest.approx(9_000_001 / 1e9)
    report = ceiling.to_dict({"nxdplug": 0.018, "hf": 0.036})
    assert report["prefill_flops"]["total"] == 9_000_001
    assert report["gemm_gflop_per_s"] == 1.0
    assert report["fraction_of_ceiling"]["nxdplug"] == pytest.approx(ceiling.ttft_floor / 0.018)
    assert report["fraction_of_ceiling"]["hf"] * 2 == pytest.approx(
        report["fraction_of_ceiling"]["nxdplug"]
    )
