"""The serving engine over two tensor-parallel ranks: the first schedules and broadcasts each
step, the second follows; every request gets HF transformers' greedy tokens, and the one that
asks for its prompt's log-probabilities gets HF's; over cache lines, and over blocks with a
prefix found in the cache. Each launch then serves again speculating, with ``ngram`` (its
verifications are steps every rank runs) and, over lines, with a draft model (sharded over the
ranks, its steps run on every rank; or whole on the first rank alone), fused EAGLE and Medusa
token trees and an EAGLE-3 chain (their sub-models and cache moves run on every rank): greedy
requests get HF's tokens, and the single rank's tokens and speculation counts."""

from __future__ import annotations

import argparse
from pathlib import Path

import attrs
import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from nxdplug import NeuronConfig, from_pretrained
from nxdplug.cli.speculation import engine_draft
from nxdplug.engine.speculative import SpeculativeConfig
from nxdplug.testing import end_rank_process
from tests.core.modules.test_tensor_parallel import become_launched_rank, free_port
from tests.plugins.eagle.test_eagle import TREE, bigram_target, eagle_app, make_eagle_draft
from tests.plugins.eagle.test_eagle3 import make_eagle3_draft
from tests.plugins.medusa.test_medusa import WIDE, heads_like_lm_head, medusa_options, with_heads

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
# Speculation: longer requests, so that some proposals are kept and some are not. The draft
# model, EAGLE and Medusa keep line caches of their own, so they run over lines alone.
TREE_NODES = sum(len(children) for children in TREE.values())  # below the root
DRAFT_MODEL = {"method": "draft_model", "num_speculative_tokens": 3}
SPECULATIVE_CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "draft-model": DRAFT_MODEL,
    "draft-alone": DRAFT_MODEL | {"draft_tensor_parallel_size": 1},
    "eagle-tree": {"method": "eagle", "num_speculative_tokens": TREE_NODES},
    "eagle3-chain": {"method": "eagle3", "num_speculative_tokens": 3},
    "medusa-tree": {"method": "medusa", "num_speculative_tokens": len(WIDE)},
}
SPECULATING_TOKENS = [30, 24, 30, 32, 28]


def _speculating(blocks: bool) -> list[str]:
    return ["ngram"] if blocks else list(SPECULATIVE_CONFIGS)


def _checkpoints(folder: Path, target: Path) -> dict[str, str]:
    """Each scenario's checkpoint: the tiny Llama; a near-bigram target with a draft model
    that is its bigram alone (which agrees with it on about 3 tokens in 5), with an EAGLE
    draft and, 4 layers deep, with an EAGLE-3 head (both often guess it right); Medusa heads
    beside the tiny Llama."""
    eagle_target = bigram_target(folder / "eagle-target")
    # EAGLE-3 reads 3 layers; its guessing head passes each query head's K/V head through
    eagle3_target = bigram_target(
        folder / "eagle3-target", num_hidden_layers=4, num_key_value_heads=4
    )
    heads = heads_like_lm_head(target, len(WIDE[-1]), 0.5, 0)
    return {
        "plain": str(target),
        "ngram": str(target),
        "draft-model": str(eagle_target),
        "draft-alone": str(eagle_target),
        "draft": str(bigram_target(folder / "draft", residual=0.0)),
        "eagle-tree": str(eagle_target),
        "eagle-draft": str(make_eagle_draft(eagle_target, folder / "eagle-draft")),
        "eagle3-chain": str(eagle3_target),
        "eagle3-draft": str(
            make_eagle3_draft(eagle3_target, folder / "eagle3-draft", 448, bigram=True)
        ),
        "medusa-tree": str(with_heads(folder / "medusa", target, heads)),
    }


def _application(name: str, checkpoints: dict[str, str], blocks: bool, tp_degree: int = 2):
    """Scenario ``name``'s model."""
    lines = {"tp_degree": tp_degree, "is_continuous_batching": True, "batch_size": 2}
    if name in ("eagle-tree", "eagle3-chain"):
        draft = Path(checkpoints[name.split("-")[0] + "-draft"])
        if name == "eagle-tree":
            options = {"k": TREE_NODES + 1, "token_tree_config": TREE}
        else:
            options = {"k": 3, "is_eagle3": True}
        return eagle_app(Path(checkpoints[name]), draft, **options, **lines)
    settings = SETTINGS | lines | (BLOCKS if blocks else {})
    if name == "ngram" or name.startswith("draft-"):
        settings["speculation_length"] = SPECULATIVE_CONFIGS[name]["num_speculative_tokens"]
    elif name == "medusa-tree":
        # the last verification writes the tree's 10 nodes from the newest token on
        settings |= medusa_options(WIDE, heads=len(WIDE[-1])) | {"seq_len": 64}
    app = from_pretrained(checkpoints[name], NeuronConfig(**settings))
    app.to_cpu()
    return app


def _draft(name: str, checkpoints: dict[str, str], app):
    """Scenario ``name``'s draft model, built as ``nxdplug serve --enforce-eager`` builds it
    on each rank beside ``app``: None where this rank holds none."""
    if not name.startswith("draft-"):
        return None
    config = SpeculativeConfig.from_mapping(
        SPECULATIVE_CONFIGS[name] | {"model": checkpoints["draft"]}, "the test"
    )
    args = argparse.Namespace(
        speculative_config=config,
        model_path=None,
        compiled_model_path=None,
        enforce_eager=True,
        compiler_args=None,
        quiet=True,
    )
    return engine_draft(args, app.config)


def _engine(name: str, app, runner=None, draft=None):
    from nxdplug.engine import Engine

    config = SPECULATIVE_CONFIGS.get(name)
    return Engine(
        app, eos_token_ids=[], runner=runner, speculative_config=config, draft_model=draft
    )


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


def _rank(
    rank: int, world: int, port: int, checkpoints: dict[str, str], out: str, blocks: bool
) -> None:
    become_launched_rank(rank, world, port)
    from nxdplug.engine.ranks import StepBroadcaster, follow_steps

    results = {}
    for name in ["plain", *_speculating(blocks)]:
        app = _application(name, checkpoints, blocks)
        draft = _draft(name, checkpoints, app)
        others = {} if draft is None else {"draft": draft}
        if rank != 0:
            follow_steps(app, others)
            continue
        if name == "draft-alone":  # the first rank's draft is whole, the other rank has none
            results["draft-alone-degree"] = draft.neuron_config.tp_degree
        runner = StepBroadcaster(app, heartbeat_seconds=0.05, others=others)
        engine = _engine(name, app, runner, draft)
        if name == "plain":
            results[name] = _serve(engine, MAX_TOKENS, SCORED_PROMPT)
        else:
            tokens = _serve(engine, SPECULATING_TOKENS, None)[0]
            results[name] = (tokens, attrs.asdict(engine.speculation.metrics))
        runner.stop()
    if rank == 0:
        torch.save(results, Path(out) / "results.pt")
    end_rank_process()


def _hf_greedy(checkpoint: str, counts: list[int]) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for prompt, count in zip(PROMPTS, counts, strict=True):
            ids = hf.generate(
                torch.tensor([prompt]), max_new_tokens=count, do_sample=False, eos_token_id=None
            )
            expected.append(ids[0, len(prompt) :].tolist())
    return expected


@pytest.mark.parametrize("blocks", [False, True], ids=["lines", "blocks-prefix-caching"])
def test_two_ranks_serve_hf_greedy_tokens(tiny_checkpoint, tmp_path, blocks) -> None:
    checkpoint = tiny_checkpoint("llama", seed=1, initializer_range=0.15)
    checkpoints = _checkpoints(tmp_path, checkpoint)
    args = (2, free_port(), checkpoints, str(tmp_path), blocks)
    mp.spawn(_rank, args=args, nprocs=2, join=True)
    results = torch.load(tmp_path / "results.pt")
    hf = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.inference_mode():
        prompt = torch.tensor([PROMPTS[1]])
        logprobs = hf(prompt).logits[0, :-1].log_softmax(-1)
        expected_scores = logprobs.gather(-1, prompt[0, 1:, None])[:, 0].tolist()
    tokens, scores, cached = results["plain"]
    assert tokens == _hf_greedy(str(checkpoint), MAX_TOKENS)
    assert cached == ([0, 0, 0, 0, 8] if blocks else [0] * len(PROMPTS))
    assert scores == pytest.approx(expected_scores, abs=1e-4)

    if not blocks:
        assert results["draft-alone-degree"] == 1
    one_rank: dict[tuple[str, str], dict] = {}  # the single rank's counts, by target and method
    for name in _speculating(blocks):
        tokens, metrics = results[name]
        expected = _hf_greedy(checkpoints[name], SPECULATING_TOKENS)
        assert tokens == expected, name
        key = (checkpoints[name], SPECULATIVE_CONFIGS[name]["method"])
        if key not in one_rank:
            app = _application(name, checkpoints, blocks, tp_degree=1)
            engine = _engine(name, app, draft=_draft(name, checkpoints, app))
            assert _serve(engine, SPECULATING_TOKENS, None)[0] == expected, name
            one_rank[key] = attrs.asdict(engine.speculation.metrics)
        assert metrics == one_rank[key], name
        assert 0 < metrics["accepted_tokens"] < metrics["draft_tokens"], (name, metrics)
        if name.endswith("-tree"):  # a kept node at depth 2 is off the chain: its rows moved
            assert metrics["accepted_per_position"][1] > 0, (name, metrics)
