"""The serving engine over two tensor-parallel ranks: the first schedules and broadcasts each
step, the second follows; every request gets HF transformers' greedy tokens, and the one that
asks for its prompt's log-probabilities gets HF's; over cache lines, and over blocks with a
prefix found in the cache."""

from __future__ import annotations

from pathlib import Path

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


def _rank(rank: int, world: int, port: int, checkpoint: str, out: str, blocks: bool) -> None:
    become_launched_rank(rank, world, port)
    from nxdplug.engine import Engine, SamplingSettings
    from nxdplug.engine.ranks import StepBroadcaster, follow_steps

    app = from_pretrained(checkpoint, NeuronConfig(**SETTINGS, **(BLOCKS if blocks else {})))
    app.to_cpu()
    if rank != 0:
        follow_steps(app)
        end_rank_process()
    runner = StepBroadcaster(app, heartbeat_seconds=0.05)
    engine = Engine(app, eos_token_ids=[], runner=runner)
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
    for index, (prompt, count) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        scored = SCORED_PROMPT if index == 1 else None
        order.append(engine.add_request(prompt, SamplingSettings(count, 0, prompt_logprobs=scored)))
        take(engine.step())
    while engine.has_unfinished():
        take(engine.step())
    result = ([tokens[r] for r in order], scores, [cached[r] for r in order])
    torch.save(result, Path(out) / "tokens.pt")
    runner.stop()
    end_rank_process()


@pytest.mark.parametrize("blocks", [False, True], ids=["lines", "blocks-prefix-caching"])
def test_two_ranks_serve_hf_greedy_tokens(tiny_checkpoint, tmp_path, blocks) -> None:
    checkpoint = tiny_checkpoint("llama", seed=1, initializer_range=0.15)
    args = (2, free_port(), str(checkpoint), str(tmp_path), blocks)
    mp.spawn(_rank, args=args, nprocs=2, join=True)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    expected = []
    with torch.inference_mode():
        for prompt, count in zip(PROMPTS, MAX_TOKENS, strict=True):
            ids = hf.generate(
                torch.tensor([prompt]), max_new_tokens=count, do_sample=False, eos_token_id=None
            )
            expected.append(ids[0, len(prompt) :].tolist())
        prompt = torch.tensor([PROMPTS[1]])
        logprobs = hf(prompt).logits[0, :-1].log_softmax(-1)
        expected_scores = logprobs.gather(-1, prompt[0, 1:, None])[:, 0].tolist()
    tokens, scores, cached = torch.load(tmp_path / "tokens.pt")
    assert tokens == expected
    assert cached == ([0, 0, 0, 0, 8] if blocks else [0] * len(PROMPTS))
    assert scores == pytest.approx(expected_scores, abs=1e-4)
