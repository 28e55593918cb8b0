"""On-device sampling: the graph samples and returns tokens, with HF's distribution.

The statistical tests draw N tokens from fixed logits and compare the counts with the
probabilities of HF's TemperatureLogitsWarper / TopKLogitsWarper / TopPLogitsWarper processing of
the same logits by a chi-square test at significance level ALPHA. The noise comes from a fixed
seed, so each test gives the same answer every run; a deliberately wrong temperature is rejected.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    AutoModelForCausalLM,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from nxdplug import (
    HuggingFaceGenerationAdapter,
    NeuronConfig,
    OnDeviceSamplingConfig,
    from_pretrained,
)
from nxdplug.compile.artefacts import Manifest
from nxdplug.errors import ConfigError, NotSupportedError
from nxdplug.pipeline import config_problems, select_plugins
from nxdplug.plugins.sampling.on_device import (
    OnDeviceSampler,
    SamplingParamsError,
    candidate_scores,
)
from nxdplug.testing import chi_square_p_value

SETTINGS = {"batch_size": 2, "seq_len": 64, "max_context_length": 16, "torch_dtype": "float32"}
PROMPTS = torch.tensor([[0, 0, 11, 42, 7, 99], [3, 14, 15, 92, 65, 35]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
ALPHA = 1e-3  # chi-square significance level
DRAWS = 20_000  # tokens drawn per setting


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama", seed=3)


def make_app(checkpoint, sampling: dict | None = None, **options):
    neuron_config = NeuronConfig(**(SETTINGS | options), on_device_sampling_config=sampling)
    app = from_pretrained(checkpoint, neuron_config)
    app.to_cpu()
    return app


def generate(app, **kwargs) -> torch.Tensor:
    adapter = HuggingFaceGenerationAdapter(app)
    return adapter.generate(PROMPTS, attention_mask=MASK, max_new_tokens=12, **kwargs)


SAMPLING = {"do_sample": True, "dynamic": True}


# The feature and its config checks --------------------------------------------------------------


def test_the_config_enables_the_feature_and_installs_the_sampler(checkpoint) -> None:
    app = make_app(checkpoint, {})
    assert "on-device-sampling" in {f.name for f in select_plugins(app.config).features}
    assert isinstance(app.context_encoding_model.model.output_stage.sampler, OnDeviceSampler)
    host = make_app(checkpoint)
    assert "on-device-sampling" not in {f.name for f in select_plugins(host.config).features}
    assert not hasattr(host.context_encoding_model.model.output_stage, "sampler")


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"top_k": 0}, "top_k is 0; it must be a whole number, 1 or more"),
        ({"top_k": 40, "global_topk": 32}, "top_k (40) is larger than global_topk (32)"),
        ({"global_topk": 600}, "global_topk (600) is larger than the vocabulary (vocab_size=512)"),
        ({"top_p": 1.5}, "top_p is 1.5; it must be in (0, 1]"),
        ({"temperature": 0.0}, "temperature is 0.0; it must be above 0"),
    ],
)
def test_config_problems_are_reported(checkpoint, sampling, message) -> None:
    config = make_app(checkpoint).config
    config.neuron_config.on_device_sampling_config = sampling
    assert any(message in problem for problem in config_problems(config))
    with pytest.raises(ConfigError, match="configuration problem"):
        make_app(checkpoint, sampling)


# Greedy ----------------------------------------------------------------------------------------


def test_greedy_on_device_equals_host_greedy_and_hf(checkpoint) -> None:
    on_device = generate(make_app(checkpoint, {}), eos_token_id=None)
    host = generate(make_app(checkpoint), eos_token_id=None)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.inference_mode():
        expected = hf.generate(
            PROMPTS, attention_mask=MASK, max_new_tokens=12, do_sample=False, pad_token_id=0
        )
    assert torch.equal(on_device, host)
    assert torch.equal(on_device, expected)
    assert len(set(on_device[0, 6:].tolist())) >= 4


def test_top_k_1_sampling_is_greedy(checkpoint) -> None:
    greedy = generate(make_app(checkpoint, {}))
    sampled = generate(make_app(checkpoint, {"do_sample": True, "top_k": 1, "temperature": 2.0}))
    assert torch.equal(sampled, greedy)


def test_output_logits_equal_the_logits_of_the_model_without_sampling(checkpoint) -> None:
    host = make_app(checkpoint)
    with_logits = make_app(checkpoint, {}, output_logits=True)
    tokens_only = make_app(checkpoint, {})
    next_ids = torch.tensor([[5], [6]])
    next_mask = torch.cat([MASK, torch.ones(2, 1, dtype=torch.long)], dim=-1)
    for ids, mask in ((PROMPTS, MASK), (next_ids, next_mask)):  # context encoding, then a step
        expected = host(input_ids=ids, attention_mask=mask)
        out = with_logits(input_ids=ids, attention_mask=mask)
        assert expected.tokens is None
        assert torch.equal(out.logits, expected.logits)
        assert torch.equal(out.tokens, expected.logits.argmax(-1))
        assert out.tokens.shape == (2, 1)
        bare = tokens_only(input_ids=ids, attention_mask=mask)
        assert bare.logits is None and torch.equal(bare.tokens, out.tokens)


def test_on_device_greedy_returns_the_host_scores_and_logits(checkpoint) -> None:
    kwargs = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True}
    host = generate(make_app(checkpoint), **kwargs)
    on_device = generate(make_app(checkpoint, {}, output_logits=True), **kwargs)
    assert torch.equal(on_device.sequences, host.sequences)
    for name in ("scores", "logits"):
        for ours, theirs in zip(getattr(on_device, name), getattr(host, name), strict=True):
            assert torch.equal(ours, theirs)


# HF's distribution ------------------------------------------------------------------------------


def hf_probabilities(logits: torch.Tensor, top_k: int, top_p: float, temperature: float):
    """softmax of HF's warpers in generate()'s order: temperature, top-k, top-p."""
    scores = TemperatureLogitsWarper(temperature)(None, logits)
    scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(dim=-1)


def our_probabilities(logits: torch.Tensor, params: torch.Tensor, global_topk: int):
    scores, candidates = candidate_scores(logits, params, global_topk)
    full = torch.full_like(logits, float("-inf")).scatter(-1, candidates, scores)
    return full.softmax(dim=-1)


@settings(max_examples=60, deadline=None)
@given(
    top_k=st.integers(1, 32),
    top_p=st.floats(0.05, 1.0),
    temperature=st.floats(0.2, 3.0),
    seed=st.integers(0, 2**16),
)
def test_candidate_probabilities_equal_hf_warpers(top_k, top_p, temperature, seed) -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(seed)) * 3
    params = torch.tensor([[top_k, top_p, temperature]]).expand(3, 3)
    ours = our_probabilities(logits, params, global_topk=32)
    expected = hf_probabilities(logits, top_k, top_p, temperature)
    assert torch.equal(ours > 0, expected > 0)
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)


LOGITS = torch.randn(40, generator=torch.Generator().manual_seed(0)) * 2
# (top_k, top_p, temperature): one batch holds DRAWS rows of each, interleaved.
ROW_SETTINGS = [(12, 0.9, 0.8), (5, 1.0, 1.5), (30, 0.8, 1.2), (32, 1.0, 1.0)]


def draw(row_settings: list[tuple[float, float, float]], seed: int = 1234) -> torch.Tensor:
    """DRAWS tokens for each setting, drawn in one batch: [len(row_settings), vocab] counts."""
    sampler = OnDeviceSampler(OnDeviceSamplingConfig(do_sample=True, global_topk=32))
    params = torch.tensor(row_settings).repeat(DRAWS, 1)
    noise = torch.rand(len(params), 32, generator=torch.Generator().manual_seed(seed))
    tokens = sampler(LOGITS.expand(len(params), -1), params, noise)
    counts = torch.zeros(len(row_settings), len(LOGITS), dtype=torch.long)
    rows = torch.arange(len(params)) % len(row_settings)
    return counts.index_put_((rows, tokens), torch.ones_like(tokens), accumulate=True)


def test_sampled_tokens_follow_hf_distribution_row_by_row() -> None:
    counts = draw(ROW_SETTINGS)
    for setting, row_counts in zip(ROW_SETTINGS, counts, strict=True):
        expected = hf_probabilities(LOGITS[None], *setting)[0]
        assert chi_square_p_value(row_counts, expected) > ALPHA, setting


def test_a_wrong_temperature_is_rejected() -> None:
    """Temperature 0.9 in place of 0.8, over the same 12 tokens."""
    counts = draw([(12, 1.0, 0.9)])[0]
    assert chi_square_p_value(counts, hf_probabilities(LOGITS[None], 12, 1.0, 0.8)[0]) < ALPHA


# Dynamic sampling and refusals -----------------------------------------------------------------


def test_dynamic_rows_in_one_batch_follow_their_own_settings(checkpoint) -> None:
    app = make_app(checkpoint, SAMPLING, batch_size=4, output_logits=True)
    rows = torch.tensor([[1, 1.0, 1.0], [3, 1.0, 1.0], [50, 1e-6, 3.0], [50, 1.0, 3.0]])
    torch.manual_seed(0)
    out = HuggingFaceGenerationAdapter(app).generate(
        PROMPTS.repeat(2, 1),
        attention_mask=MASK.repeat(2, 1),
        sampling_params=rows,
        max_new_tokens=16,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_logits=True,
    )
    logits = torch.stack(out.logits, dim=1)  # [batch, step, vocab]
    chosen = out.sequences[:, PROMPTS.shape[1] :]
    rank = (logits > logits.gather(-1, chosen[..., None])).sum(-1)  # 0: the best token
    assert (rank[0] == 0).all()  # top_k 1
    assert (rank[1] < 3).all() and (rank[1] > 0).any()  # top_k 3
    assert (rank[2] == 0).all()  # a tiny top_p keeps the best token only
    assert (rank[3] > 2).any()  # temperature 3 over 50 tokens


def test_the_guides_dynamic_sampling_samples_each_row_without_do_sample(checkpoint) -> None:
    """The feature guide's example: dynamic=True alone, rows of (top_k, top_p, temperature);
    top_k 1 is greedy, top_k 5 draws among the exact 5 best tokens, more than one of them."""
    config = NeuronConfig(
        **SETTINGS, on_device_sampling_config=OnDeviceSamplingConfig(dynamic=True)
    )
    app = from_pretrained(checkpoint, config)
    app.to_cpu()
    guide = app(
        input_ids=PROMPTS,
        attention_mask=MASK,
        sampling_params=torch.tensor([[50, 0.5, 0.75], [5, 1.0, 1.0]]),
    )
    assert guide.tokens.shape == (2, 1)
    logits = make_app(checkpoint)(input_ids=PROMPTS, attention_mask=MASK).logits[:, -1]
    top5 = logits.topk(5, dim=-1).indices
    rows = torch.tensor([[1, 1.0, 1.0], [5, 1.0, 1.0]])
    drawn: list[set[int]] = [set(), set()]
    for seed in range(200):
        torch.manual_seed(seed)
        app.reset()
        tokens = app(input_ids=PROMPTS, attention_mask=MASK, sampling_params=rows).tokens[:, 0]
        drawn[0].add(int(tokens[0]))
        drawn[1].add(int(tokens[1]))
    assert drawn[0] == {int(logits[0].argmax())}
    assert drawn[1] <= set(top5[1].tolist()) and len(drawn[1]) > 1
    # generate(): sampling_params, or the GenerationConfig's do_sample, with no do_sample in
    # the OnDeviceSamplingConfig.
    greedy = generate(make_app(checkpoint), eos_token_id=None)
    greedy_rows = torch.tensor([[1, 1.0, 1.0]] * 2)
    assert torch.equal(generate(app, sampling_params=greedy_rows, eos_token_id=None), greedy)
    assert torch.equal(generate(app, eos_token_id=None), greedy)
    torch.manual_seed(0)
    sampled = generate(app, do_sample=True, top_k=50, temperature=1.5, eos_token_id=None)
    torch.manual_seed(0)
    by_rows = generate(app, sampling_params=torch.tensor([[50, 1.0, 1.5]] * 2), eos_token_id=None)
    assert torch.equal(sampled, by_rows) and not torch.equal(sampled, greedy)


@pytest.mark.parametrize(
    ("sampling", "params", "error", "message"),
    [
        (SAMPLING, [[257, 1.0, 1.0]] * 2, SamplingParamsError, "larger than global_topk=256"),
        (SAMPLING, [[5, 0.0, 1.0]] * 2, SamplingParamsError, r"top_p must be in \(0, 1\]"),
        (SAMPLING, [[5, 1.0, 0.0]] * 2, SamplingParamsError, "temperature must be a finite"),
        (SAMPLING, [[2.5, 1.0, 1.0]] * 2, SamplingParamsError, "top_k must be a whole number"),
        (SAMPLING, [[5, 1.0, 1.0]], SamplingParamsError, r"shape \[batch, 3\] = \[2, 3\]"),
        ({"do_sample": True}, [[5, 1.0, 1.0]] * 2, SamplingParamsError, "dynamic is False"),
        (None, [[5, 1.0, 1.0]] * 2, NotSupportedError, "enabled by on_device_sampling_config"),
    ],
)
def test_sampling_params_are_honoured_or_refused(checkpoint, sampling, params, error, message):
    app = make_app(checkpoint, sampling)
    with pytest.raises(error, match=message):
        app(input_ids=PROMPTS, attention_mask=MASK, sampling_params=torch.tensor(params))


def test_a_greedy_model_warns_that_sampling_params_are_unused(checkpoint) -> None:
    """NxD Inference's sampler takes the argmax when neither do_sample nor dynamic is set,
    whatever sampling_params say (its generation demo passes some): the same tokens here, and
    a warning instead of silence."""
    app = make_app(checkpoint, {})
    greedy = app(input_ids=PROMPTS, attention_mask=MASK).tokens
    with pytest.warns(RuntimeWarning, match="sampling_params are not used"):
        given = app(
            input_ids=PROMPTS,
            attention_mask=MASK,
            sampling_params=torch.tensor([[50, 0.5, 0.75], [5, 1.0, 1.0]]),
        ).tokens
    assert torch.equal(given, greedy)


@pytest.mark.parametrize(
    ("sampling", "kwargs", "message"),
    [
        ({}, {"output_scores": True}, r"need the model's logits.*output_logits=True"),
        ({"do_sample": True}, {"temperature": 0.5}, r"asked for temperature=0\.5"),
        ({}, {"do_sample": True}, "asked for do_sample=True"),
        (SAMPLING, {"do_sample": True, "top_k": 0}, "top_k=0 keeps every token"),
    ],
)
def test_generate_refuses_what_the_model_cannot_honour(checkpoint, sampling, kwargs, message):
    app = make_app(checkpoint, sampling)
    with pytest.raises(NotSupportedError, match=message):
        generate(app, return_dict_in_generate=True, **kwargs)


def test_generation_config_settings_become_sampling_params(checkpoint) -> None:
    app = make_app(checkpoint, SAMPLING)
    greedy = generate(make_app(checkpoint))
    assert torch.equal(generate(app), greedy)  # the checkpoint's greedy generation config
    assert torch.equal(generate(app, do_sample=True, top_k=1), greedy)
    torch.manual_seed(3)
    sampled = generate(app, do_sample=True, top_k=50, temperature=1.5)
    rows = torch.tensor([[50, 1.0, 1.5]] * 2)
    torch.manual_seed(3)
    assert torch.equal(generate(app, sampling_params=rows), sampled)
    assert not torch.equal(sampled, greedy)


# Randomness ------------------------------------------------------------------------------------


def test_a_seed_makes_sampling_reproducible(checkpoint) -> None:
    app = make_app(checkpoint, {"do_sample": True, "top_k": 50, "temperature": 1.5})
    torch.manual_seed(0)
    first = generate(app)
    torch.manual_seed(0)
    assert torch.equal(generate(app), first)
    torch.manual_seed(1)
    assert not torch.equal(generate(app), first)


def test_deterministic_gives_the_same_tokens_after_reset(checkpoint) -> None:
    app = make_app(
        checkpoint, {"do_sample": True, "top_k": 50, "temperature": 1.5, "deterministic": True}
    )
    torch.manual_seed(0)
    first = generate(app)
    torch.manual_seed(1)
    assert torch.equal(generate(app), first)
    app.reset()
    tokens = app(input_ids=PROMPTS, attention_mask=MASK).tokens
    app.reset()
    assert torch.equal(app(input_ids=PROMPTS, attention_mask=MASK).tokens, tokens)


# The compiled graphs ---------------------------------------------------------------------------


def test_compiled_graphs_sample_and_give_the_eager_tokens(checkpoint, tmp_path, monkeypatch):
    """One compile (two graphs); the draw is in the graphs, which return tokens only."""
    monkeypatch.delenv("NXDPLUG_CACHE_DIR", raising=False)
    neuron_config = NeuronConfig(**SETTINGS, on_device_sampling_config=SAMPLING)
    from_pretrained(checkpoint, neuron_config).compile(tmp_path, debug=True, quiet=True)
    compiled = from_pretrained(checkpoint, neuron_config)
    compiled.load(tmp_path, quiet=True)
    eager = make_app(checkpoint, SAMPLING)

    for graph in Manifest.read(tmp_path).graphs:
        text = (tmp_path / graph.file).with_suffix(".graph.txt").read_text()
        assert "aten.topk" in text and "aten.argmax" in text
    out = compiled(input_ids=PROMPTS, attention_mask=MASK)
    assert out.logits is None and out.tokens.shape == (2, 1)

    assert torch.equal(generate(compiled), generate(eager))
    sampling = {"do_sample": True, "top_k": 50, "temperature": 1.5}
    torch.manual_seed(11)
    expected = generate(eager, **sampling)
    torch.manual_seed(11)
    assert torch.equal(generate(compiled, **sampling), expected)


def test_benchmark_and_logit_check_work_with_on_device_sampling(tmp_path) -> None:
    from nxdplug import NeuronConfig, OnDeviceSamplingConfig, from_pretrained
    from nxdplug.errors import NxdPlugError
    from nxdplug.plugins.benchmark.measurements import measure_nxdplug
    from nxdplug.testing import make_tiny_checkpoint, random_prompts, teacher_forced_logits

    path = make_tiny_checkpoint("llama", tmp_path / "ckpt", seed=2)
    app = from_pretrained(
        path,
        NeuronConfig(
            torch_dtype="float32",
            seq_len=32,
            on_device_sampling_config=OnDeviceSamplingConfig(),
        ),
    )
    app.to_cpu()
    ids, _ = random_prompts(app.config.vocab_size, (6,))
    (run,) = measure_nxdplug(app, ids, new_tokens=4, runs=1, warmup=0)
    assert len(run.tokens) == 4
    with pytest.raises(NxdPlugError, match=r"output_logits=True"):
        teacher_forced_logits(app, ids, torch.ones_like(ids), ids[:, :2])
