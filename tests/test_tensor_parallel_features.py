"""Features over two tensor-parallel ranks (gloo, one process each): the fp8 KV cache and
speculation (a draft model, prompt lookup).

Each rank's greedy tokens must equal one process's: the fp8 cache's own (it changes the tokens
of this random model, so the unquantized ones are no oracle), HF transformers' greedy tokens for
speculation, which is lossless.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_tensor_parallel import (
    MASK,
    NEW_TOKENS,
    PROMPTS,
    assert_every_rank_generated,
    become_launched_rank,
    generate,
    hf_greedy_tokens,
    spawn_two_ranks,
)

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained
from nxdplug.testing import end_rank_process

pytestmark = pytest.mark.slow

BASE = {"torch_dtype": "float32", "batch_size": 2, "seq_len": 48, "max_context_length": 16}
SPECULATING = {"speculation_length": 3, "trace_tokengen_model": False}


def app_of(checkpoint: str, tp_degree: int, **settings):
    app = from_pretrained(checkpoint, NeuronConfig(**BASE, tp_degree=tp_degree, **settings))
    app.to_cpu()
    return app


def tokens_of(checkpoint: str, case: str, tp_degree: int) -> tuple[torch.Tensor, float | None]:
    """Greedy tokens of PROMPTS with ``case``'s feature, over ``tp_degree`` ranks, and the
    share of speculated tokens accepted (None without speculation)."""
    if case == "fp8":
        return generate(app_of(checkpoint, tp_degree, kv_cache_quant=True)), None
    target = app_of(checkpoint, tp_degree, **SPECULATING)
    how = {"prompt_lookup_num_tokens": 2}
    if case == "draft":  # the target itself as the draft: every speculated token accepted
        how = {"assistant_model": app_of(checkpoint, tp_degree)}
    tokens = HuggingFaceGenerationAdapter(target).generate(
        PROMPTS, attention_mask=MASK, max_new_tokens=NEW_TOKENS, eos_token_id=None, **how
    )
    return tokens, target.speculation_stats.acceptance_rate


CASES = ("fp8", "draft", "prompt-lookup")


def _rank(rank: int, world: int, port: int, checkpoint: str, out: str) -> None:
    become_launched_rank(rank, world, port)
    for case in CASES:
        tokens, accepted = tokens_of(checkpoint, case, world)
        torch.save(tokens, Path(out) / f"{case}-{rank}.pt")
        torch.save(accepted, Path(out) / f"{case}-accepted-{rank}.pt")
    end_rank_process()


@pytest.fixture(scope="module")
def two_ranks(tiny_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    checkpoint = tiny_checkpoint("llama", seed=11)
    work = tmp_path_factory.mktemp("tp2-features")
    spawn_two_ranks(_rank, str(checkpoint), str(work))
    return checkpoint, work


def test_the_fp8_cache_gives_one_processs_tokens_on_every_rank(two_ranks) -> None:
    checkpoint, work = two_ranks
    expected, _ = tokens_of(str(checkpoint), "fp8", 1)
    assert not torch.equal(expected, hf_greedy_tokens(checkpoint))  # fp8 changes this path
    assert_every_rank_generated(work, "fp8", expected)


@pytest.mark.parametrize("case", ["draft", "prompt-lookup"])
def test_speculation_is_lossless_on_every_rank(two_ranks, case: str) -> None:
    checkpoint, work = two_ranks
    assert_every_rank_generated(work, case, hf_greedy_tokens(checkpoint))
    accepted = [torch.load(work / f"{case}-accepted-{rank}.pt") for rank in range(2)]
    if case == "draft":
        assert accepted == [1.0, 1.0]
    else:  # the lookup drafted, and was right at least once (1 of 111 tokens)
        assert accepted[0] == accepted[1] > 0
