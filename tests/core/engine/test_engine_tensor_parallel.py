"""The serving engine over two tensor-parallel ranks: the first schedules and broadcasts each
step, the second follows; every request gets HF transformers' greedy tokens, and the one that
asks for its prompt's log-probabilities gets HF's; over cache lines, and over blocks with a
prefix found in the cache. Each launch then serves again with ``ngram`` speculation: the
verifications are steps every rank runs, and the tokens are HF's and the single rank's."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from nxdplug import NeuronConfig, from_pretrained
from nxdplug.testing import end_rank_process
from tests.core.modules.test_tensor_parallel import become_launched_rank, free_port

pytestmark = pytest.mark.slow

SETTINGS = {
    "torch_dtype": "float32",
    "tp_degree": 2,
    "is_continuous_batching": True,
    "batch_size": 2,
    "seq_len": 48,
    "max_context_length": 16,
    "enable_prompt_logprobs": True,
}
PROMPTS = [[5, 17, 42, 9], [8, 250, 31, 99, 7, 3, 11], [60, 61, 62], list(range(70, 82))]
# The last request repeats the fourth prompt's first 10 tokens (its first block of 8 is cached).
PROMPTS.append([*PROMPTS[3][:10], 5, 6])
MAX_TOKENS = [12, 6, 9, 8, 7]
# The block layout with prefix caching: each rank holds its K/V heads' blocks.
BLOCKS = {"is_block_kv_layout": True, "pa_block_size": 8, "is_prefix_caching": True}
SCORED_PROMPT = 2  # the second prompt's request asks for its log-probabilities, 2 alternatives
# ngram speculation: longer requests, so that some proposals are kept and some are not.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
NGRAM_TOKENS = [30, 24, 30, 32, 28]


def _application(checkpoint: str, blocks: bool, speculating: bool, tp_degree: int = 2):
    settings = SETTINGS | {"tp_degree": tp_degree} | (BLOCKS if blocks else {})
    app = from_pretrained(
        checkpoint, NeuronConfig(**settings, **({"speculation_length": 3} if speculating else {}))
    )
    app.to_cpu()
    return app


def _serve(engine, counts: list[int], scored: int | None):
    """Each prompt's tokens, the scored request's prompt log-probabilities and each request's
    cached tokens; one request arrives each step."""
    from nxdplug.engine import SamplingSettings

    tokens: dict[str, list[int]] = {}
    scores: list[float] = []
    cached: dict[str, int] = {}

    def take(outputs) -> None:
        for output in outputs:
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
            cached[output.request_id] = output.cached_tokens
            if output.prompt_logprobs is not None:
                scores.extend(s.logprob for s in output.prompt_logprobs[1:])

    order = []
    for index, (prompt, count) in enumerate(zip(PROMPTS, counts, strict=True)):
        logprobs = scored if index == 1 else None
        order.append(
            engine.add_request(prompt, SamplingSettings(count, 0, prompt_logprobs=logprobs))
        )
        take(engine.step())
    while engine.has_unfinished():
        take(engine.step())
    return [tokens[r] for r in order], scores, [cached[r] for r in order]


def _rank(rank: int, world: int, port: int, checkpoint: str, out: str, blocks: bool) -> None:
    become_launched_rank(rank, world, port)
    from nxdplug.engine import Engine
    from nxdplug.engine.ranks import StepBroadcaster, follow_steps

    results = {}
    for speculating in (False, True):
        app = _application(checkpoint, blocks, speculating)
        if rank != 0:
            follow_steps(app)
            continue
        runner = StepBroadcaster(app, heartbeat_seconds=0.05)
        if speculating:
            engine = Engine(app, eos_token_ids=[], runner=runner, speculative_config=NGRAM)
            results["ngram"] = _serve(engine, NGRAM_TOKENS, None)[0]
            results["metrics"] = attrs.asdict(engine.speculation.metrics)
        else:
            engine = Engine(app, eos_token_ids=[], runner=runner)
            results["plain"] = _serve(engine, MAX_TOKENS, SCORED_PROMPT)
        runner.stop()
    if rank == 0:
        torch.save(results, Path(out) / "results.pt")
    end_rank_process()


def _hf_greedy(hf, counts: list[int]) -> list[list[int]]:
    expected = []
    for prompt, count in zip(PROMPTS, counts, strict=True):
        ids = hf.generate(
            torch.tensor([prompt]), max_new_tokens=count, do_sample=False, eos_token_id=None
        )
        expected.append(ids[0, len(prompt) :].tolist())
    return expected


@pytest.mark.parametrize("blocks", [False, True], ids=["lines", "blocks-prefix-caching"])
def test_two_ranks_serve_hf_greedy_tokens(tiny_checkpoint, tmp_path, blocks) -> None:
    checkpoint = tiny_checkpoint("llama", seed=1, initializer_range=0.15)
    args = (2, free_port(), str(checkpoint), str(tmp_path), blocks)
    mp.spawn(_rank, args=args, nprocs=2, join=True)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.inference_mode():
        expected = _hf_greedy(hf, MAX_TOKENS)
        prompt = torch.tensor([PROMPTS[1]])
        logprobs = hf(prompt).logits[0, :-1].log_softmax(-1)
        expected_scores = logprobs.gather(-1, prompt[0, 1:, None])[:, 0].tolist()
        expected_ngram = _hf_greedy(hf, NGRAM_TOKENS)
    results = torch.load(tmp_path / "results.pt")
    tokens, scores, cached = results["plain"]
    assert tokens == expected
    assert cached == ([0, 0, 0, 0, 8] if blocks else [0] * len(PROMPTS))
    assert scores == pytest.approx(expected_scores, abs=1e-4)

    # ngram over the ranks: HF's tokens, and the single rank's, with the same verifications
    from nxdplug.engine import Engine

    one_rank = Engine(
        _application(str(checkpoint), blocks, True, tp_degree=1),
        eos_token_ids=[],
        speculative_config=NGRAM,
    )
    assert results["ngram"] == expected_ngram
    assert _serve(one_rank, NGRAM_TOKENS, None)[0] == expected_ngram
    metrics = results["metrics"]
    assert metrics == attrs.asdict(one_rank.speculation.metrics)
    assert 0 < metrics["accepted_tokens"] < metrics["draft_tokens"], metrics  # some kept, some not
