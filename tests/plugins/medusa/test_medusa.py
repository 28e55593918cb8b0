"""Medusa speculative decoding (``is_medusa=True``): heads loading, tree, config checks, and
greedy output identical to the target's own, eager and compiled.

Losslessness is checked on the trained pycoder-tiny heads (real, partial acceptance) and on a
tiny random model whose heads are noisy copies of its LM head (so some branches are accepted,
which exercises the K/V moves), for prompts of different lengths, batch 1 and 2 (left padded).

Acceptance (``python -m tests.plugins.medusa.test_medusa`` measures it on the first 20
``file_start`` prompts of prompts.jsonl, 64 new tokens, 4 heads): see docs/speculative-decoding.md;
``test_trained_heads_are_accepted`` checks a smaller sample against a floor.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GenerationConfig

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained
from nxdplug.config import InferenceConfig, load_pretrained_config
from nxdplug.engine import Engine, RequestError, SamplingSettings
from nxdplug.engine.speculative import SpeculativeConfig
from nxdplug.errors import CheckpointError, ConfigError, NotSupportedError, NxdPlugError
from nxdplug.pipeline import config_problems, select_plugins
from nxdplug.plugins.medusa.engine import engine_settings
from nxdplug.plugins.medusa.heads import add_medusa_heads
from nxdplug.plugins.medusa.tree import MedusaTree
from nxdplug.runtime.speculation import AcceptanceStats
from nxdplug.testing import (
    chi_square_p_value,
    exact_top_k_marginals,
    make_tiny_checkpoint,
    random_prompts,
)
from tests.core.engine.test_engine_speculation import serve
from tests.shipped_models import PYCODER, PYCODER_MEDUSA, file_start_prompts

CHAIN = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
WIDE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
HEADS_FILE = "medusa_lm_head.safetensors"
PYCODER_HEADS = PYCODER_MEDUSA / HEADS_FILE


def medusa_options(tree: list[list[int]], heads: int = 4) -> dict:
    return {
        "is_medusa": True,
        "num_medusa_heads": heads,
        "medusa_tree": tree,
        "medusa_speculation_length": len(tree) + 1,
    }


def load(path: Path, **options) -> object:
    defaults = {"batch_size": 2, "seq_len": 64, "max_context_length": 16, "torch_dtype": "float32"}
    app = from_pretrained(path, NeuronConfig(**(defaults | options)))
    app.to_cpu()
    return app


def generate(app, input_ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=0, pad_token_id=0
    )
    return HuggingFaceGenerationAdapter(app).generate(
        input_ids, attention_mask=mask, generation_config=config
    )


def heads_like_lm_head(checkpoint: Path, num_heads: int, noise: float, seed: int) -> dict:
    """Medusa-format heads: a small random ResBlock, then the LM head plus noise (Medusa's own
    initialisation, perturbed): right on repetitive text, often wrong elsewhere."""
    lm_head = load_file(checkpoint / "model.safetensors")["lm_head.weight"]
    vocab, hidden = lm_head.shape
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    heads = {}
    for i in range(num_heads):
        heads[f"{i}.0.linear.weight"] = 0.02 * randn(hidden, hidden)
        heads[f"{i}.0.linear.bias"] = 0.02 * randn(hidden)
        heads[f"{i}.1.weight"] = lm_head + noise * lm_head.std() * randn(vocab, hidden)
    return {name: tensor.half() for name, tensor in heads.items()}


def with_heads(folder: Path, checkpoint: Path, heads: dict, name: str = HEADS_FILE) -> Path:
    """``folder``: the checkpoint's files (linked) plus a heads file."""
    folder.mkdir(parents=True)
    for file in checkpoint.iterdir():
        (folder / file.name).symlink_to(file)
    if name.endswith(".safetensors"):
        save_file(heads, folder / name)
    else:
        torch.save(heads, folder / name)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("medusa")
    checkpoint = make_tiny_checkpoint("llama", root / "target", seed=3)
    return with_heads(root / "with_heads", checkpoint, heads_like_lm_head(checkpoint, 4, 0.5, 0))


@pytest.fixture(scope="module")
def pycoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("pycoder") / "with_heads"
    folder.mkdir()
    for file in [*PYCODER.iterdir(), PYCODER_HEADS]:
        (folder / file.name).symlink_to(file)
    return folder


def held_out_prompts(count: int) -> list[torch.Tensor]:
    """The first ``count`` ``file_start`` prompts of prompts.jsonl (64 tokens each)."""
    return [torch.tensor([ids]) for ids in file_start_prompts(count)]


# The tree


def test_tree_tables_masks_and_acceptance() -> None:
    tree = MedusaTree([[1], [0], [0, 0], [0, 1]])  # ordered: root, [0], [1], [0,0], [0,1]
    assert tree.size == 5 and tree.max_depth == 2 and tree.top_k == 2
    assert tree.parent.tolist() == [0, 0, 0, 1, 1]
    assert tree.head.tolist() == [0, 0, 1, 1] and tree.rank.tolist() == [0, 1, 0, 1]
    top = torch.tensor([[[10, 11], [20, 21]]])  # head 0 best: 10, 11; head 1: 20, 21
    assert tree.candidates(torch.tensor([7]), top).tolist() == [[7, 10, 11, 20, 21]]

    mask = tree.attention_mask(torch.tensor([2, 0]), 8)
    assert mask[0].tolist() == [
        [1, 1, 1, 0, 0, 0, 0, 0],  # root: the prefix and itself
        [1, 1, 1, 1, 0, 0, 0, 0],  # [0]
        [1, 1, 1, 0, 1, 0, 0, 0],  # [1]
        [1, 1, 1, 1, 0, 1, 0, 0],  # [0, 0]: root, [0], itself
        [1, 1, 1, 1, 0, 0, 1, 0],  # [0, 1]
    ]
    assert mask[1, :, :5].tolist() == tree.ancestors.long().tolist()
    assert mask[1, :, 5:].sum() == 0
    # rotary positions under a tree mask: prefix + depth
    assert (mask[0].sum(-1) - 1).tolist() == [2, 3, 3, 4, 4]

    tokens = torch.tensor([[7, 10, 11, 20, 21]] * 3)
    targets = torch.tensor(
        [
            [10, 21, 5, 5, 5],  # [0] then [0, 1] accepted
            [11, 5, 5, 5, 5],  # [1] accepted, a leaf
            [12, 20, 5, 5, 5],  # nothing: [0, 0]'s parent [0] was rejected
        ]
    )
    best, accepted = tree.accept(tokens, targets)
    assert best.tolist() == [4, 2, 0] and accepted.tolist() == [2, 1, 0]
    assert tokens.gather(1, tree.paths[best]).tolist()[0] == [7, 10, 21]


# Losslessness


def test_random_model_output_is_the_targets(tiny: Path) -> None:
    plain = load(tiny)
    medusa = load(tiny, **medusa_options(WIDE))
    stats = AcceptanceStats()
    for lengths, seed in (((5,), 1), ((3, 11), 2), ((16, 7), 3)):
        input_ids, mask = random_prompts(512, lengths, seed=seed)
        expected = generate(plain, input_ids, mask, 24)
        assert len(set(expected[:, -24:].flatten().tolist())) > 8  # a varied greedy output
        assert torch.equal(generate(medusa, input_ids, mask, 24), expected), lengths
        stats.add(medusa.speculation_stats)
    # NxD Inference's way: the Medusa model passed as its own assistant_model
    as_assistant = HuggingFaceGenerationAdapter(medusa).generate(
        input_ids,
        attention_mask=mask,
        max_new_tokens=24,
        do_sample=False,
        eos_token_id=0,
        pad_token_id=0,
        assistant_model=medusa,
    )
    assert torch.equal(as_assistant, expected)
    # the lm_head-like heads are right now and then: accepted branches were moved into place
    assert 0 < stats.accepted < stats.row_calls * 3


def test_trained_heads_are_lossless_and_accepted(pycoder: Path) -> None:
    options = {"seq_len": 128, "max_context_length": 64}
    plain = load(pycoder, **options)
    medusa = load(pycoder, **options, **medusa_options(WIDE))
    prompts = held_out_prompts(3)
    # batch 1 at 64 tokens, then a left-padded batch of two lengths
    for input_ids in prompts[:2]:
        mask = torch.ones_like(input_ids)
        assert torch.equal(
            generate(medusa, input_ids, mask, 32), generate(plain, input_ids, mask, 32)
        )
        assert medusa.speculation_stats.mean_accepted > 0.3  # measured: 0.33 and 1.91
    input_ids = torch.zeros(2, 64, dtype=torch.long)
    input_ids[0], input_ids[1, 24:] = prompts[1], prompts[2][0, :40]
    mask = torch.ones_like(input_ids)
    mask[1, :24] = 0
    assert torch.equal(generate(medusa, input_ids, mask, 32), generate(plain, input_ids, mask, 32))


def never_right_heads(hidden: int, vocab: int, tokens: list[int], heads: int) -> dict:
    """Heads whose top-k are ``tokens`` in order, whatever the hidden state: ResBlock linear
    zero with a large bias on dimension 0, projection rows +-e_0."""
    big = 1000.0
    state = {}
    for i in range(heads):
        bias = torch.zeros(hidden)
        bias[0] = big
        projection = torch.zeros(vocab, hidden)
        projection[:, 0] = -1.0
        for rank, token in enumerate(tokens):
            projection[token, 0] = 1.0 - 0.01 * rank
        state[f"{i}.0.linear.weight"] = torch.zeros(hidden, hidden)
        state[f"{i}.0.linear.bias"] = bias
        state[f"{i}.1.weight"] = projection
    return state


def test_heads_that_are_always_wrong_change_nothing(tiny: Path, tmp_path: Path) -> None:
    plain = load(tiny)
    input_ids, mask = random_prompts(512, (6, 12), seed=4)
    expected = generate(plain, input_ids, mask, 20)
    unused = [t for t in range(1, 512) if t not in set(expected.flatten().tolist())][:3]
    checkpoint = tiny.parent / "target"
    folder = with_heads(tmp_path / "wrong", checkpoint, never_right_heads(64, 512, unused, 4))
    medusa = load(folder, **medusa_options(WIDE))
    assert torch.equal(generate(medusa, input_ids, mask, 20), expected)
    stats = medusa.speculation_stats
    assert stats.accepted == 0 and stats.row_calls > 0
    assert stats.emitted == stats.row_calls  # one token per call: the target's own


# Heads files


def heads_config(folder: Path, heads: int = 2, **options) -> InferenceConfig:
    neuron_config = NeuronConfig(torch_dtype="float32", **medusa_options([[0]], heads), **options)
    return InferenceConfig(neuron_config, load_config=load_pretrained_config(folder))


def test_every_heads_file_format_gives_the_same_weights(tiny: Path, tmp_path: Path) -> None:
    checkpoint = tiny.parent / "target"
    heads = load_file(tiny / HEADS_FILE)
    expected = add_medusa_heads({}, heads_config(tiny))
    assert sorted(expected) == [
        f"medusa_head.{i}.{rest}"
        for i in range(2)
        for rest in ("0.linear.bias", "0.linear.weight", "1.weight")
    ]
    assert expected["medusa_head.1.1.weight"].dtype == torch.float32
    assert torch.equal(expected["medusa_head.1.1.weight"], heads["1.1.weight"].float())
    nxdi = {f"medusa_head_{name}": tensor for name, tensor in heads.items()}
    for name, state in (("medusa_lm_head.pt", heads), ("medusa_heads.pt", nxdi)):
        folder = with_heads(tmp_path / name, checkpoint, state, name)
        converted = add_medusa_heads({}, heads_config(folder))
        assert converted.keys() == expected.keys()
        assert all(torch.equal(converted[k], expected[k]) for k in expected)
    # heads already merged into the checkpoint (as NxD Inference does) need no file
    merged = add_medusa_heads({"norm.weight": torch.ones(1), **nxdi}, heads_config(checkpoint))
    assert merged.keys() == {"norm.weight", *expected}


def test_missing_or_mismatched_heads_are_clear_errors(tiny: Path) -> None:
    checkpoint = tiny.parent / "target"
    with pytest.raises(CheckpointError) as missing:
        load(checkpoint, **medusa_options(CHAIN[:2], heads=2))
    for part in (str(checkpoint), "medusa_lm_head.safetensors", "medusa_heads.pt"):
        assert part in str(missing.value)
    with pytest.raises(CheckpointError, match="no weights for head\\(s\\) \\[4\\]"):
        add_medusa_heads({}, heads_config(tiny, heads=5))
    with pytest.raises(CheckpointError, match="set medusa_num_layers=1"):
        add_medusa_heads({}, heads_config(tiny, medusa_num_layers=2))


# Config checks


def test_config_problems_say_what_to_set(tiny: Path) -> None:
    def problems(**options) -> str:
        config = InferenceConfig(NeuronConfig(**options), load_config=load_pretrained_config(tiny))
        return " | ".join(config_problems(config))

    assert select_plugins(heads_config(tiny)).speculation_mode.name == "medusa"
    assert problems(**medusa_options(CHAIN)) == ""
    assert "needs medusa_tree" in problems(is_medusa=True, num_medusa_heads=4)
    wrong_length = problems(**(medusa_options(CHAIN) | {"medusa_speculation_length": 64}))
    assert "set medusa_speculation_length=5" in wrong_length
    assert "needs its prefix(es) [[0]]" in problems(**medusa_options([[0, 0], [1]]))
    assert "deeper than num_medusa_heads=2" in problems(**medusa_options(CHAIN, heads=2))
    assert "not a non-empty list" in problems(**medusa_options([[0], []]))
    assert "repeats the path(s) [0]" in problems(**medusa_options([[0], [0]]))
    assert "beyond the vocabulary" in problems(**medusa_options([[0], [600]]))
    assert "num_medusa_heads of 1 or more" in problems(**medusa_options(CHAIN, heads=0))
    nowhere = problems(**medusa_options(CHAIN), medusa_heads_path=str(tiny / "nowhere"))
    assert "give the folder of the Medusa heads file" in nowhere
    with pytest.raises(ConfigError, match="medusa_speculation_length=5"):
        from_pretrained(
            tiny, NeuronConfig(**(medusa_options(CHAIN) | {"medusa_speculation_length": 4}))
        )


def test_sampled_medusa_follows_the_target_distribution(tiny: Path) -> None:
    """Top-k sampling through the tree: the first three new tokens against their exact
    marginals (HF transformers over every path)."""
    rows, calls, top_k = 64, 30, 4
    medusa = load(tiny, batch_size=rows, **medusa_options(WIDE))
    prompt = torch.tensor([3, 9, 4, 17, 5])
    adapter = HuggingFaceGenerationAdapter(medusa)
    torch.manual_seed(0)
    counts = torch.zeros(3, medusa.config.vocab_size, dtype=torch.long)
    stats = AcceptanceStats()
    for _ in range(calls):
        out = adapter.generate(
            prompt.expand(rows, -1),
            do_sample=True,
            top_k=top_k,
            max_new_tokens=3,
            eos_token_id=None,
        )
        for position in range(3):
            counts[position] += torch.bincount(out[:, 5 + position], minlength=len(counts[0]))
        stats.add(medusa.speculation_stats)
    assert stats.accepted > 0, "the tree must be followed sometimes"
    for position, marginal in enumerate(exact_top_k_marginals(tiny, prompt, 3, top_k)):
        assert chi_square_p_value(counts[position], marginal) > 1e-3, position


def test_other_proposers_and_too_short_sequences_are_refused(tiny: Path) -> None:
    medusa = load(tiny, **medusa_options(CHAIN))
    input_ids, mask = random_prompts(512, (8,), seed=1)
    with pytest.raises(NxdPlugError, match="needs seq_len >= 68"):
        generate(medusa, input_ids, mask, 56)
    with pytest.raises(NotSupportedError, match="its own heads"):
        HuggingFaceGenerationAdapter(medusa).generate(
            input_ids, attention_mask=mask, max_new_tokens=4, assistant_model=load(tiny)
        )


# In the serving engine (vLLM's medusa method)


def test_the_engine_serves_medusa_losslessly(pycoder: Path) -> None:
    """pycoder-tiny's trained heads: requests of different lengths, arriving at different
    steps, get HF's greedy tokens (float32) and the engine's own without speculation; seeded
    sampled ones draw what they draw without it. Kept paths go deeper than one node, off the
    tree's first chain too, so their cache rows were moved."""
    prompts = [ids[-n:] for ids, n in zip(file_start_prompts(4), (64, 23, 40, 9), strict=True)]
    max_tokens = [20, 12, 24, 10]
    hf = AutoModelForCausalLM.from_pretrained(pycoder, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = [
            hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None)[
                0, len(p) :
            ].tolist()
            for p, n in zip(prompts, max_tokens, strict=True)
        ]
    lines = {"is_continuous_batching": True, "batch_size": 3, "seq_len": 128}
    lines["max_context_length"] = 64
    medusa = load(pycoder, **lines, **medusa_options(WIDE))
    plain = load(pycoder, **lines)
    config = {"method": "medusa", "num_speculative_tokens": len(WIDE)}
    greedy = [SamplingSettings(n, 0) for n in max_tokens]
    speculating = Engine(medusa, eos_token_ids=[], speculative_config=config)
    assert serve(speculating, prompts, greedy)[0] == expected
    assert serve(Engine(plain, eos_token_ids=[]), prompts, greedy)[0] == expected
    metrics = speculating.speculation.metrics
    per_depth = metrics.accepted_per_position
    assert len(per_depth) == 4 and per_depth == sorted(per_depth, reverse=True)
    assert sum(per_depth) == metrics.accepted_tokens and per_depth[1] > 0
    assert 0 < metrics.draft_tokens <= len(WIDE) * metrics.drafts

    sampled = [SamplingSettings(n, 0.8, top_k=20, seed=n, logprobs=True) for n in max_tokens]
    plain_tokens, plain_logprobs, _ = serve(Engine(plain), prompts, sampled)
    tokens, logprobs, _ = serve(Engine(medusa, speculative_config=config), prompts, sampled)
    assert tokens == plain_tokens
    for row, row_expected in zip(logprobs, plain_logprobs, strict=True):
        torch.testing.assert_close(row, row_expected, atol=1e-4, rtol=0)


def test_the_engines_medusa_settings_and_refusals(tiny: Path) -> None:
    """vLLM's medusa config: ``num_speculative_tokens`` heads' best tokens make a chain, or
    ``speculative_token_tree`` gives the tree; ``model`` is the heads' folder."""
    heads_folder = tiny.parent / "heads"
    heads_folder.mkdir()
    (heads_folder / HEADS_FILE).symlink_to(tiny / HEADS_FILE)
    (heads_folder / "config.json").write_text('{"medusa_num_heads": 4, "medusa_num_layers": 1}')

    def settings(**values) -> dict:
        return engine_settings(SpeculativeConfig.from_mapping({"method": "medusa"} | values, "x"))

    chain = settings(num_speculative_tokens=3, model=str(heads_folder))
    assert chain["medusa_tree"] == CHAIN[:3] and chain["num_medusa_heads"] == 3
    assert chain["medusa_speculation_length"] == 4 and chain["speculation_length"] == 0
    assert chain["medusa_heads_path"] == str(heads_folder) and chain["medusa_num_layers"] == 1
    tree = settings(speculative_token_tree=str([tuple(p) for p in WIDE]))
    assert sorted(tree["medusa_tree"]) == sorted(WIDE) and tree["num_medusa_heads"] == 4
    with pytest.raises(ConfigError, match="is not a folder"):
        settings(num_speculative_tokens=3, model=str(tiny / "nowhere"))
    with pytest.raises(ConfigError, match="needs num_speculative_tokens"):
        settings()

    # the heads of their own folder, beside a checkpoint that has none
    checkpoint = tiny.parent / "target"
    lines = {"is_continuous_batching": True, "batch_size": 2}
    apart = load(
        checkpoint, **lines, **medusa_options(CHAIN[:3]), medusa_heads_path=str(heads_folder)
    )
    beside = load(tiny, **lines, **medusa_options(CHAIN[:3]))
    prompts = [[5, 9, 31, 7], [3, 8]]
    greedy = [SamplingSettings(12, 0)] * 2
    config = {"method": "medusa", "model": str(heads_folder), "num_speculative_tokens": 3}
    tokens = serve(Engine(apart, eos_token_ids=[], speculative_config=config), prompts, greedy)
    plain = Engine(load(checkpoint, **lines), eos_token_ids=[])
    assert tokens[0] == serve(plain, prompts, greedy)[0]
    refusing = Engine(apart, eos_token_ids=[], speculative_config=config)
    room = 64 - len(prompts[0]) - 2  # the last call writes the tree's 4 nodes from its root
    with pytest.raises(RequestError, match=f"ask for at most {room} tokens"):
        refusing.add_request(prompts[0], SamplingSettings(room + 1))
    assert len(serve(refusing, [prompts[0]], [SamplingSettings(room, 0)])[0][0]) == room
    asked = re.escape("""--speculative-config '{"method": "medusa"}'""")
    with pytest.raises(ConfigError, match=asked):
        Engine(beside)

    for wrong, message in [
        ({"num_speculative_tokens": 2}, "a token tree of 3 nodes below its root"),
        ({"speculative_token_tree": "[(0,), (1,), (0, 0)]"}, "is not the tree the model was"),
        ({"model": str(tiny)}, "is not the folder of the heads the model was built with"),
    ]:
        with pytest.raises(ConfigError, match=message):
            Engine(apart, speculative_config={"method": "medusa"} | wrong)
    with pytest.raises(ConfigError, match="own heads: give no draft model"):
        Engine(apart, speculative_config={"method": "medusa"}, draft_model=beside)


# Compiled


def test_compiled_medusa_matches_eager(tiny: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("NXDPLUG_CACHE_DIR", raising=False)
    options = {"trace_tokengen_model": False, **medusa_options(WIDE)}
    eager = load(tiny, **options)
    compiled = from_pretrained(
        tiny,
        NeuronConfig(
            batch_size=2, seq_len=64, max_context_length=16, torch_dtype="float32", **options
        ),
    )
    compiled.compile(tmp_path / "compiled", quiet=True)
    compiled.load(tmp_path / "compiled", quiet=True)
    input_ids, mask = random_prompts(512, (9, 4), seed=6)
    expected = generate(eager, input_ids, mask, 24)
    assert torch.equal(generate(compiled, input_ids, mask, 24), expected)
    assert compiled.speculation_stats.as_dict() == eager.speculation_stats.as_dict()


# Acceptance on the trained heads (python -m tests.plugins.medusa.test_medusa prints the figures of
# docs/speculative-decoding.md)


def measure_acceptance(folder: Path, tree: list[list[int]], prompts: list, new_tokens: int) -> dict:
    """Acceptance over ``prompts`` one at a time, and the wall time of Medusa and of plain
    greedy decoding on the same target."""
    options = {"batch_size": 1, "seq_len": 160, "max_context_length": 64}
    plain = load(folder, **options)
    medusa = load(folder, **options, **medusa_options(tree))
    total, seconds = AcceptanceStats(), {"plain": 0.0, "medusa": 0.0}
    for input_ids in prompts:
        mask = torch.ones_like(input_ids)
        for name, app in (("plain", plain), ("medusa", medusa)):
            started = time.perf_counter()
            output = generate(app, input_ids, mask, new_tokens)
            seconds[name] += time.perf_counter() - started
            if name == "plain":
                expected = output
        assert torch.equal(output, expected)
        stats = medusa.speculation_stats
        total.row_calls += stats.row_calls
        total.drafted += stats.drafted
        total.accepted += stats.accepted
        total.emitted += stats.emitted
    return total.as_dict() | {f"{k}_seconds": round(v, 2) for k, v in seconds.items()}


def test_trained_heads_are_accepted(pycoder: Path) -> None:
    figures = measure_acceptance(pycoder, CHAIN, held_out_prompts(4), 32)
    assert figures["mean_accepted_per_call"] > 0.35, figures  # measured: 0.45 (40 of 88 calls)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "pycoder"
        folder.mkdir()
        for file in [*PYCODER.iterdir(), PYCODER_HEADS]:
            (folder / file.name).symlink_to(file)
        prompts = held_out_prompts(20)
        for label, tree in (("chain k=4", CHAIN), (f"{len(WIDE)}-node tree", WIDE)):
            print(label, measure_acceptance(folder, tree, prompts, 64), file=sys.stdout)
