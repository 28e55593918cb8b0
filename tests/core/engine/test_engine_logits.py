"""The engine's per-request logit adjustments and top log-probabilities, against HF transformers.

HF's own processors are the oracle where HF has one (``repetition_penalty``, ``sequence_bias``,
``min_new_tokens``); OpenAI's frequency and presence penalties, which HF lacks, are checked
against a greedy loop over HF's logits that subtracts them as OpenAI documents. Every adjusted
request must differ from the plain greedy one, so that each check can fail.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from nxdplug.engine import Engine, RequestError, SamplingSettings
from nxdplug.testing import chi_square_p_value
from tests.core.engine.test_engine import DYNAMIC, app_for

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama", seed=1, initializer_range=0.15)


@pytest.fixture(scope="module")
def hf(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (6, 11, 4)]


def hf_generate(hf, prompt: list[int], **settings) -> list[int]:
    """HF's greedy tokens after ``prompt`` with its own processors' ``settings``."""
    settings = {"eos_token_id": None} | settings
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            **settings,
        )
    return out[0, len(prompt) :].tolist()


def engine_tokens(engine: Engine, requests: list[tuple[list[int], SamplingSettings]]):
    """Every request run at once through ``engine``; each one's tokens, in order."""
    ids = [engine.add_request(prompt, settings) for prompt, settings in requests]
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.token_ids
    return [tokens[request_id] for request_id in ids]


def greedy(**settings) -> SamplingSettings:
    return SamplingSettings(NEW_TOKENS, 0, **settings)


def test_penalties_and_bias_are_hf_processors_per_request(checkpoint, hf, prompts) -> None:
    """Adjusted and plain requests in one batch: each gets what HF gives its prompt alone."""
    plain = [hf_generate(hf, prompt) for prompt in prompts]
    banned, favoured = plain[1][0], plain[1][4]
    cases = [
        (prompts[2], {"repetition_penalty": 1.6}, {"repetition_penalty": 1.6}),
        (prompts[1], {}, {}),
        (
            prompts[1],
            {"logit_bias": [(banned, -100.0), (favoured, 3.0)]},
            {"sequence_bias": [[[banned], -100.0], [[favoured], 3.0]]},
        ),
        (prompts[0], {"repetition_penalty": 0.7}, {"repetition_penalty": 0.7}),
    ]
    engine = Engine(app_for(checkpoint), eos_token_ids=[])
    got = engine_tokens(engine, [(prompt, greedy(**ours)) for prompt, ours, _ in cases])
    for (prompt, ours, theirs), tokens in zip(cases, got, strict=True):
        assert tokens == hf_generate(hf, prompt, **theirs), ours
        if ours:
            assert tokens != plain[prompts.index(prompt)], f"{ours} changed nothing"
    assert got[1] == plain[1]
    assert engine.lines.in_use == 0


def test_min_tokens_holds_back_eos_as_hf_min_new_tokens(checkpoint, hf, prompts) -> None:
    plain = hf_generate(hf, prompts[0])
    eos = plain[2]
    engine = Engine(app_for(checkpoint), eos_token_ids=[eos])
    early, held = engine_tokens(
        engine, [(prompts[0], greedy()), (prompts[0], greedy(min_tokens=8))]
    )
    assert early == plain[: plain.index(eos) + 1]
    expected = hf_generate(hf, prompts[0], eos_token_id=eos, min_new_tokens=8)
    if eos in expected:
        expected = expected[: expected.index(eos) + 1]
    assert held == expected and len(held) >= 8 and eos not in held[:8]
    (stop_token,) = engine_tokens(
        engine, [(prompts[0], greedy(ignore_eos=True, stop_token_ids=[eos]))]
    )
    assert stop_token == early
    (held_stop,) = engine_tokens(
        engine, [(prompts[0], greedy(ignore_eos=True, stop_token_ids=[eos], min_tokens=8))]
    )
    assert eos not in held_stop[:8] and len(held_stop) >= 8


def openai_penalized_greedy(hf, prompt: list[int], frequency: float, presence: float) -> list[int]:
    """Greedy decoding over HF's logits minus OpenAI's penalties on the output so far."""
    output: list[int] = []
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            logits = hf(torch.tensor([prompt + output])).logits[0, -1].float()
            for token, count in Counter(output).items():
                logits[token] -= frequency * count + presence
            output.append(int(logits.argmax()))
    return output


@pytest.mark.parametrize(("frequency", "presence"), [(1.5, 0.0), (0.0, 2.0), (0.8, 0.6)])
def test_frequency_and_presence_penalties_are_openais(
    checkpoint, hf, prompts, frequency, presence
) -> None:
    engine = Engine(app_for(checkpoint), eos_token_ids=[])
    settings = greedy(frequency_penalty=frequency, presence_penalty=presence)
    penalized, plain = engine_tokens(engine, [(prompts[2], settings), (prompts[2], greedy())])
    assert penalized == openai_penalized_greedy(hf, prompts[2], frequency, presence)
    assert plain == hf_generate(hf, prompts[2]) and penalized != plain


def test_a_sampled_request_samples_from_the_adjusted_logits(checkpoint, prompts) -> None:
    engine = Engine(app_for(checkpoint), eos_token_ids=[])
    forced = SamplingSettings(NEW_TOKENS, 1.0, seed=3, logit_bias=[(77, 100.0)])
    free = SamplingSettings(NEW_TOKENS, 1.0, seed=3)
    biased, unbiased = engine_tokens(engine, [(prompts[0], forced), (prompts[0], free)])
    assert biased == [77] * NEW_TOKENS and unbiased != biased


def test_min_p_draws_from_hfs_min_p_warped_distribution(checkpoint, hf, prompts) -> None:
    """First tokens drawn with ``min_p`` (and top-p beside it) keep to HF's warped
    distribution: TemperatureLogitsWarper, TopPLogitsWarper then MinPLogitsWarper."""
    engine = Engine(app_for(checkpoint), eos_token_ids=[])
    temperature, top_p, min_p, draws = 1.5, 0.95, 0.2, 400
    asked = [
        (prompts[1], SamplingSettings(1, temperature, top_p=top_p, min_p=min_p, seed=seed))
        for seed in range(draws)
    ]
    counts = torch.zeros(hf.config.vocab_size)
    for tokens in engine_tokens(engine, asked):
        counts[tokens[0]] += 1
    with torch.inference_mode():
        logits = hf(torch.tensor([prompts[1]])).logits[:, -1].float()
    ids = torch.tensor([prompts[1]])
    scores = TopPLogitsWarper(top_p)(ids, TemperatureLogitsWarper(temperature)(ids, logits))
    warped = MinPLogitsWarper(min_p)(ids, scores)[0]
    kept = int(torch.isfinite(warped).sum())
    assert 3 <= kept < int(torch.isfinite(scores).sum())  # min_p filters, and leaves a choice
    assert chi_square_p_value(counts, warped.softmax(dim=-1)) > 1e-3


def test_top_logprobs_are_hfs_and_of_the_model_before_adjustment(checkpoint, hf, prompts) -> None:
    engine = Engine(app_for(checkpoint), eos_token_ids=[])
    settings = greedy(logprobs=True, top_logprobs=3, repetition_penalty=1.6)
    request = engine.add_request(prompts[2], settings)
    tokens, logprobs, top = [], [], []
    while engine.has_unfinished():
        for output in engine.step():
            assert output.request_id == request
            tokens += output.token_ids
            logprobs += output.logprobs
            top += output.top_logprobs
    assert tokens == hf_generate(hf, prompts[2], repetition_penalty=1.6)
    with torch.inference_mode():
        logits = hf(torch.tensor([prompts[2] + tokens])).logits[0].log_softmax(-1)
    start = len(prompts[2]) - 1
    for i, (token, logprob, pairs) in enumerate(zip(tokens, logprobs, top, strict=True)):
        values, ids = logits[start + i].topk(3)
        assert [t for t, _ in pairs] == ids.tolist()
        assert [lp for _, lp in pairs] == pytest.approx(values.tolist(), abs=1e-4)
        assert logprob == pytest.approx(logits[start + i, token].item(), abs=1e-4)
    assert any(token != pairs[0][0] for token, pairs in zip(tokens, top, strict=True)), (
        "the penalty never moved the choice off the model's likeliest token"
    )


@pytest.mark.parametrize(
    ("settings", "field", "message"),
    [
        ({"repetition_penalty": 0.0}, "repetition_penalty", "must be > 0"),
        ({"min_p": 1.5}, "min_p", "must be in"),
        ({"presence_penalty": 2.5}, "presence_penalty", "must be in \\[-2, 2\\]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty", "must be in \\[-2, 2\\]"),
        ({"logit_bias": [(5, 101.0)]}, "logit_bias", "bias must be in \\[-100, 100\\]"),
        ({"logit_bias": [(10**6, 1.0)]}, "logit_bias", "outside the vocabulary"),
        ({"min_tokens": 20}, "min_tokens", "must be in \\[0, max_tokens\\]"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "must be in \\[0, 20\\]"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ],
)
def test_bad_adjustments_are_refused(checkpoint, settings, field, message) -> None:
    engine = Engine(app_for(checkpoint))
    with pytest.raises(RequestError, match=message) as caught:
        engine.add_request([1, 2], SamplingSettings(10, **settings))
    assert caught.value.field == field


def test_a_model_sampling_in_its_graph_refuses_adjustments(checkpoint) -> None:
    engine = Engine(app_for(checkpoint, **DYNAMIC))
    for settings, field in [
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"logit_bias": [(3, 1.0)]}, "logit_bias"),
        ({"min_tokens": 2}, "min_tokens"),
    ]:
        with pytest.raises(RequestError, match="on_device_sampling_config") as caught:
            engine.add_request([1, 2], SamplingSettings(10, 0, **settings))
        assert caught.value.field == field
    with pytest.raises(RequestError, match="on_device_sampling_config") as caught:
        engine.add_request([1, 2], SamplingSettings(10, 1.0, min_p=0.1))
    assert caught.value.field == "min_p"


def test_a_bad_max_tokens_is_reported_alone_beside_min_tokens() -> None:
    settings = SamplingSettings(max_tokens=None, min_tokens=2)
    assert [field for field, _ in settings.problems()] == ["max_tokens"]
