"""The serving engine over two tensor-parallel ranks: the first schedules and broadcasts each
step, the second follows; every request gets HF transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from test_tensor_parallel import become_launched_rank, free_port
from transformers import AutoModelForCausalLM

from nxdplug import NeuronConfig, from_pretrained
from nxdplug.testing import end_rank_process

pytestmark = pytest.mark.slow

SETTINGS = {
    "torch_dtype": "float32",
    "tp_degree": 2,
    "is_continuous_batching": True,
    "batch_size": 2,
    "seq_len": 48,
    "max_context_length": 16,
}
PROMPTS = [[5, 17, 42, 9], [8, 250, 31, 99, 7, 3, 11], [60, 61, 62]]
MAX_TOKENS = [12, 6, 9]


def _rank(rank: int, world: int, port: int, checkpoint: str, out: str) -> None:
    become_launched_rank(rank, world, port)
    from nxdplug.engine import Engine, SamplingSettings
    from nxdplug.engine.ranks import StepBroadcaster, follow_steps

    app = from_pretrained(checkpoint, NeuronConfig(**SETTINGS))
    app.to_cpu()
    if rank != 0:
        follow_steps(app)
        end_rank_process()
    runner = StepBroadcaster(app, heartbeat_seconds=0.05)
    engine = Engine(app, eos_token_ids=[], runner=runner)
    tokens: dict[str, list[int]] = {}
    order = []
    for prompt, count in zip(PROMPTS, MAX_TOKENS, strict=True):
        order.append(engine.add_request(prompt, SamplingSettings(count, 0)))
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
    torch.save([tokens[r] for r in order], Path(out) / "tokens.pt")
    runner.stop()
    end_rank_process()


def test_two_ranks_serve_hf_greedy_tokens(tiny_checkpoint, tmp_path) -> None:
    checkpoint = tiny_checkpoint("llama", seed=1, initializer_range=0.15)
    mp.spawn(_rank, args=(2, free_port(), str(checkpoint), str(tmp_path)), nprocs=2, join=True)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    expected = []
    with torch.inference_mode():
        for prompt, count in zip(PROMPTS, MAX_TOKENS, strict=True):
            ids = hf.generate(
                torch.tensor([prompt]), max_new_tokens=count, do_sample=False, eos_token_id=None
            )
            expected.append(ids[0, len(prompt) :].tolist())
    assert torch.load(tmp_path / "tokens.pt") == expected
