"""Speculative decoding in the serving engine (vLLM's ``speculative_config``: ``ngram`` and
``draft_model``), on the shipped pycoder-tiny with its draft and on a random tiny Llama.

Each request's output must be what it is without speculation: greedy tokens are HF
transformers' own; a seeded sampled request draws the same tokens (the engine draws each
position as a decode step would); penalties, logit bias, logprobs, stop strings and structured
outputs behave as without speculation.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nxdplug import NeuronConfig, from_pretrained
from nxdplug.engine import Engine, RequestError, SamplingSettings
from nxdplug.engine.speculative import DraftTree, SpeculativeConfig
from nxdplug.errors import ConfigError
from tests.shipped_models import PYCODER, PYCODER_DRAFT, PYCODER_EAGLE

TARGET, DRAFT, EAGLE = PYCODER, PYCODER_DRAFT, PYCODER_EAGLE
SETTINGS = {
    "torch_dtype": "float32",
    "is_continuous_batching": True,
    "batch_size": 4,
    "seq_len": 96,
    "max_context_length": 48,
}
BLOCKS = {"is_block_kv_layout": True, "is_prefix_caching": True, "pa_block_size": 8}
CODE = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "import os\n\n\ndef main():\n    for name in os.listdir('.'):\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
    "x = [1, 2, 3]\ny = [",
]
MAX_TOKENS = [24, 16, 30, 20, 12]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def application(path: Path, **settings):
    app = from_pretrained(path, NeuronConfig(**(SETTINGS | settings)))
    app.to_cpu()
    return app


def serve(engine: Engine, prompts, settings) -> tuple[list[list[int]], list[list[float]], int]:
    """Each prompt's tokens and logprobs, one request arriving every other step; the steps."""
    queue = list(zip(prompts, settings, strict=True))
    order: list[str] = []
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    steps = 0
    while queue or engine.has_unfinished():
        if queue and steps % 2 == 0:
            order.append(engine.add_request(*queue.pop(0)))
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
            logprobs.setdefault(output.request_id, []).extend(output.logprobs or ())
        steps += 1
    assert engine.lines.in_use == 0
    return [tokens[r] for r in order], [logprobs[r] for r in order], steps


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(text).input_ids for text in CODE]


@pytest.fixture(scope="module")
def hf_greedy(prompts) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt, count in zip(prompts, MAX_TOKENS, strict=True):
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=count, do_sample=False, eos_token_id=None
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def draft():
    return application(DRAFT)


def greedy_settings() -> list[SamplingSettings]:
    return [SamplingSettings(count, 0) for count in MAX_TOKENS]


@pytest.mark.parametrize("cache", ["lines", "blocks"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_requests_get_hfs_tokens_in_fewer_steps(
    prompts, hf_greedy, draft, method, cache
) -> None:
    plain = Engine(application(TARGET, **BLOCKS), eos_token_ids=[])
    _, _, plain_steps = serve(plain, prompts, greedy_settings())
    config = NGRAM if method == "ngram" else {"method": "draft_model", "num_speculative_tokens": 3}
    app = application(TARGET, speculation_length=3, **(BLOCKS if cache == "blocks" else {}))
    engine = Engine(
        app,
        eos_token_ids=[],
        speculative_config=config,
        draft_model=draft if method == "draft_model" else None,
    )
    tokens, _, steps = serve(engine, prompts, greedy_settings())

    assert tokens == hf_greedy
    metrics = engine.speculation.metrics
    assert metrics.accepted_tokens > metrics.drafts / 2, metrics
    per_position = metrics.accepted_per_position
    assert per_position == sorted(per_position, reverse=True)  # a kept token's before are kept
    assert sum(per_position) == metrics.accepted_tokens
    assert steps < plain_steps


def test_the_target_as_its_own_draft_is_always_kept(tiny_checkpoint) -> None:
    """Every proposal of a draft that is the target is kept: the draft's lines follow each
    request exactly (catching up after a full acceptance), through preemptions too."""
    checkpoint = tiny_checkpoint("llama", seed=1, initializer_range=0.15)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (3, 7, 12, 5)]
    settings = [SamplingSettings(count, 0) for count in (30, 25, 40, 33)]
    small = {"seq_len": 64, "max_context_length": 16}
    plain, _, _ = serve(
        Engine(application(checkpoint, **small), eos_token_ids=[]), prompts, settings
    )
    assert len({tuple(tokens) for tokens in plain}) == len(plain)
    tight = BLOCKS | {"pa_num_blocks": 10}  # room for about two requests: some are preempted
    app = application(checkpoint, speculation_length=4, **small, **tight)
    engine = Engine(
        app,
        eos_token_ids=[],
        speculative_config={"method": "draft_model", "num_speculative_tokens": 4},
        draft_model=application(checkpoint, **small),
    )
    tokens, _, _ = serve(engine, prompts, settings)

    assert tokens == plain
    assert engine.num_preemptions > 0
    metrics = engine.speculation.metrics
    assert metrics.draft_tokens > 0 and metrics.accepted_tokens == metrics.draft_tokens


def test_sampled_requests_draw_what_they_draw_without_speculation(prompts, draft) -> None:
    settings = [
        SamplingSettings(count, 0.9, seed=seed, logprobs=True, top_logprobs=2, **adjust)
        for count, seed, adjust in zip(
            MAX_TOKENS,
            range(5),
            [
                {"top_k": 20},
                {"repetition_penalty": 1.3},
                {"presence_penalty": 0.5, "frequency_penalty": 0.4},
                {"logit_bias": [(220, 4.0)], "min_tokens": 8, "stop_token_ids": [0]},
                {"top_p": 0.8, "min_p": 0.05},
            ],
            strict=True,
        )
    ]
    plain_tokens, plain_logprobs, _ = serve(Engine(application(TARGET)), prompts, settings)
    for config, proposer in [(NGRAM, None), ({"method": "draft_model"}, draft)]:
        app = application(TARGET, speculation_length=3)
        engine = Engine(app, speculative_config=config, draft_model=proposer)
        tokens, logprobs, _ = serve(engine, prompts, settings)
        assert tokens == plain_tokens
        for row, expected in zip(logprobs, plain_logprobs, strict=True):
            torch.testing.assert_close(row, expected, atol=1e-4, rtol=0)
        assert engine.speculation.metrics.accepted_tokens > 0


def test_stop_strings_and_structured_outputs_are_as_without_speculation(prompts, tokenizer) -> None:
    pytest.importorskip("llguidance")
    settings = [
        SamplingSettings(30, 0, stop=["return"]),
        SamplingSettings(30, 0, structured_output=("regex", r"( *self\.[a-z]+ = [a-z]+\n){2}")),
        SamplingSettings(30, 0, stop=[":\n"]),
        SamplingSettings(30, 0, structured_output=("choice", '["print(j)", "pass"]')),
        SamplingSettings(30, 0),
    ]

    def texts(engine: Engine) -> list[str]:
        order = [engine.add_request(p, s) for p, s in zip(prompts, settings, strict=True)]
        text: dict[str, str] = {}
        while engine.has_unfinished():
            for output in engine.step():
                text[output.request_id] = text.get(output.request_id, "") + output.text
        return [text[r] for r in order]

    expected = texts(Engine(application(TARGET), tokenizer))
    app = application(TARGET, speculation_length=3)
    actual = texts(Engine(app, tokenizer, speculative_config=NGRAM))
    assert actual == expected
    assert "return" not in expected[0]
    assert expected[3] in ("print(j)", "pass")


@pytest.mark.parametrize(
    ("settings", "config", "message"),
    [
        ({"speculation_length": 3}, None, "nothing proposes them"),
        ({}, NGRAM, "build it with speculation_length=k"),
        ({"speculation_length": 2}, NGRAM, "num_speculative_tokens=3 is more than"),
        ({"speculation_length": 3}, {"method": "eagle"}, "'eagle' does not run in the serving"),
        ({"speculation_length": 3}, {"method": "draft_model"}, "needs the draft model"),
        ({"speculation_length": 3}, {"method": "ngram", "k": 3}, "'k' is not a speculative"),
        ({"speculation_length": 3}, {"num_speculative_tokens": 3}, "'method' is missing"),
        (
            {"speculation_length": 3},
            {"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "1 <= min <= max",
        ),
        (
            {"speculation_length": 3},
            {"method": "ngram", "speculative_token_tree": "[(0,), (0, 0), (0, 0, 0)]"},
            "method 'ngram' proposes one chain",
        ),
    ],
)
def test_what_cannot_speculate_is_refused_at_start(settings, config, message) -> None:
    with pytest.raises(ConfigError, match=message):
        Engine(application(TARGET, **settings), speculative_config=config)


def test_a_draft_unlike_the_target_is_refused(tiny_checkpoint) -> None:
    other = application(tiny_checkpoint("llama", seed=1), batch_size=2)
    with pytest.raises(ConfigError) as refused:
        Engine(
            application(TARGET, speculation_length=3),
            speculative_config={"method": "draft_model"},
            draft_model=other,
        )
    problems = " ".join(refused.value.problems)
    assert "vocabulary" in problems and "batch_size >= 4" in problems


def test_draft_tensor_parallel_size_is_the_targets_or_one(tiny_checkpoint) -> None:
    """vLLM's draft_tensor_parallel_size: the target's tp_degree (the default) or 1, with a
    draft built for it; anything else is refused by name. The target of two ranks is built
    here as its first rank's shard (one process)."""
    checkpoint = tiny_checkpoint("llama", seed=1)
    target = application(checkpoint, tp_degree=2, speculation_length=3, batch_size=2)
    whole = application(checkpoint, batch_size=2)
    config = {"method": "draft_model", "num_speculative_tokens": 3}
    with pytest.raises(ConfigError, match=r"=3: .* give 2 \(the default\) or 1"):
        Engine(target, speculative_config=config | {"draft_tensor_parallel_size": 3})
    with pytest.raises(ConfigError, match=r"'draft_tensor_parallel_size' must be 1 .*, got 0"):
        Engine(target, speculative_config=config | {"draft_tensor_parallel_size": 0})
    with pytest.raises(
        ConfigError,
        match=r"built for tp_degree 1, but runs on 2 rank\(s\).*give draft_tensor_parallel_size 1",
    ):
        Engine(target, speculative_config=config, draft_model=whole)
    alone = Engine(
        target,
        speculative_config=config | {"draft_tensor_parallel_size": 1},
        draft_model=whole,
    )
    assert alone.speculation.proposer.ranks.application is whole


def test_ngram_lookup_takes_the_longest_latest_match() -> None:
    from nxdplug.plugins.draft_speculation.engine_proposers import NgramProposer

    lookup = NgramProposer(1, 3).lookup
    assert lookup([1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3], 2) == [9, 2]  # 3-gram beats the later 2-gram
    assert lookup([5, 1, 6, 1, 7, 1], 3) == [7, 1]  # the latest of equal matches
    assert lookup([1, 2, 3], 2) == []
    assert NgramProposer(2, 2).lookup([4, 1, 9, 1], 2) == []  # 1-grams are below min
    assert SpeculativeConfig.from_mapping({"method": "ngram"}, "x").prompt_lookup_max == 5


def test_a_token_tree_is_given_as_vllm_gives_it() -> None:
    """``speculative_token_tree``: rank paths, a Python literal in a string (vLLM's form) or
    a JSON list; ``num_speculative_tokens`` counts them."""
    config = SpeculativeConfig.from_mapping(
        {"method": "medusa", "speculative_token_tree": "[(1,), (0,), (0, 0)]"}, "x"
    )
    assert config.speculative_token_tree == ((0,), (1,), (0, 0))
    assert config.num_speculative_tokens == 3
    listed = {"method": "medusa", "speculative_token_tree": [[0], [0, 0]]}
    assert SpeculativeConfig.from_mapping(listed, "x").speculative_token_tree == ((0,), (0, 0))
    for tree, count, message in [
        ("[(0,), (0, 0)]", 3, r"'num_speculative_tokens' \(3\) must count"),
        ("[(0,), (1, 0)]", None, r"\[1, 0\] needs its prefix \[1\]"),
        ("[(0,), (-1,)]", None, "must list the tree's paths of ranks"),
        ("(0, 1", None, "must list the tree's paths of ranks"),
        ("[]", None, "must list the tree's paths of ranks"),
    ]:
        values = {"method": "medusa", "speculative_token_tree": tree}
        values |= {} if count is None else {"num_speculative_tokens": count}
        with pytest.raises(ConfigError, match=message):
            SpeculativeConfig.from_mapping(values, "x")


def test_generate_speculates_over_block_tables(prompts) -> None:
    from nxdplug import HuggingFaceGenerationAdapter

    input_ids = torch.tensor([prompts[4]])
    keywords = {
        "max_new_tokens": 20,
        "do_sample": False,
        "attention_mask": torch.ones_like(input_ids),
    }
    expected = HuggingFaceGenerationAdapter(application(TARGET)).generate(input_ids, **keywords)
    app = application(TARGET, speculation_length=3, **BLOCKS)
    actual = HuggingFaceGenerationAdapter(app).generate(
        input_ids, prompt_lookup_num_tokens=3, **keywords
    )
    assert torch.equal(actual, expected)
    assert app.speculation_stats.accepted > 0


def test_eagle_in_the_engine_is_lossless(prompts, hf_greedy) -> None:
    """Fused EAGLE (vLLM's ``eagle``) with pycoder-tiny's trained draft: greedy requests get
    HF's tokens, seeded sampled ones the draws they get without speculation."""
    from tests.plugins.eagle.test_eagle import eagle_app

    options = {"is_continuous_batching": True, "batch_size": 4, "seq_len": 96}
    options["max_context_length"] = 48

    def engine(**keywords) -> Engine:
        app = eagle_app(TARGET, EAGLE, k=3, **options)
        return Engine(app, speculative_config={"method": "eagle"}, **keywords)

    speculating = engine(eos_token_ids=[])
    tokens, _, _ = serve(speculating, prompts, greedy_settings())
    assert tokens == hf_greedy
    metrics = speculating.speculation.metrics
    assert metrics.drafts > 0 and 0 < metrics.accepted_tokens <= metrics.draft_tokens
    sampled = [SamplingSettings(n, 0.8, top_k=30, seed=n, logprobs=True) for n in MAX_TOKENS]
    expected = serve(Engine(application(TARGET)), prompts, sampled)[:2]
    actual = serve(engine(), prompts, sampled)[:2]
    assert actual[0] == expected[0]
    for row, row_expected in zip(actual[1], expected[1], strict=True):
        torch.testing.assert_close(row, row_expected, atol=1e-4, rtol=0)

    refusing = engine()
    room = 96 - len(prompts[0]) - 2  # the last call scores k - 1 = 2 positions past the end
    with pytest.raises(RequestError, match=f"ask for at most {room} tokens"):
        refusing.add_request(prompts[0], SamplingSettings(room + 1))
    refusing.add_request(prompts[0], SamplingSettings(room, 0, ignore_eos=True))
    while refusing.has_unfinished():  # its last calls write up to the last position
        refusing.step()
    with pytest.raises(RequestError, match="prompt_logprobs are not given"):
        refusing.add_request(prompts[0], SamplingSettings(4, prompt_logprobs=1))


def test_a_draft_tree_numbers_its_nodes_level_by_level() -> None:
    # root -> 1 (a), 2 (b); 1 -> 3 (c), 4 (d); 2 -> 5 (e); 3 -> 6 (f)
    tree = DraftTree([10, 11, 12, 13, 14, 15], [0, 0, 1, 1, 2, 3])
    assert tree.depths == (1, 1, 2, 2, 2, 3)
    children = [tree.child(0, 11), tree.child(1, 13), tree.child(2, 13), tree.child(3, 15)]
    assert children == [2, 4, None, 6]
    assert tree.up_to(2) == DraftTree([10, 11, 12, 13, 14], [0, 0, 1, 1, 2])
    assert tree.up_to(0) == DraftTree([], [])
    chain = DraftTree.chain([7, 8, 9])
    assert chain.parents == (0, 1, 2) and chain.depths == (1, 2, 3) and chain.child(1, 8) == 2
    with pytest.raises(ValueError, match="parent 2 is not an earlier node"):
        DraftTree([1, 2], [0, 2])
    with pytest.raises(ValueError, match="level by level"):
        DraftTree([1, 2, 3], [0, 1, 0])
    with pytest.raises(ValueError, match="one parent per token"):
        DraftTree([1, 2], [0])
