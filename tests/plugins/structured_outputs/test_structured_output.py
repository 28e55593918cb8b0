"""Structured outputs in the engine (the llguidance plugin): a choice decodes as greedy
decoding over HF transformers' logits restricted to the tokens that continue a choice as the
tokenizer writes it (llguidance keeps a fixed string to the tokenizer's own tokens for it);
regexes and JSON schemas give text that matches them; requests beside them are untouched."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nxdplug import NeuronConfig, OnDeviceSamplingConfig, from_pretrained
from nxdplug.engine import Engine, RequestError, SamplingSettings

pytest.importorskip("llguidance")

SETTINGS = {
    "torch_dtype": "float32",
    "is_continuous_batching": True,
    "batch_size": 4,
    "seq_len": 64,
    "max_context_length": 16,
}
CHOICES = ["yes", "no", "maybe so", "never"]
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama", seed=1, initializer_range=0.15)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def engine(checkpoint, tokenizer) -> Engine:
    app = from_pretrained(checkpoint, NeuronConfig(**SETTINGS))
    app.to_cpu()
    return Engine(app, tokenizer)


@pytest.fixture(scope="module")
def hf(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval()


def run(engine: Engine, requests: list[tuple[list[int], SamplingSettings]]):
    """Each request's tokens, text and finish reason, all queued at once."""
    ids = [engine.add_request(prompt, settings) for prompt, settings in requests]
    tokens = {i: [] for i in ids}
    texts = dict.fromkeys(ids, "")
    reasons = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.token_ids
            texts[output.request_id] += output.text
            if output.finished:
                reasons[output.request_id] = output.finish_reason
    assert engine.lines.in_use == 0
    return [(tokens[i], texts[i], reasons[i]) for i in ids]


def hf_choice_greedy(hf, tokenizer, prompt: list[int]) -> list[int]:
    """Greedy over HF's logits, each step among the tokens that continue a choice as the
    tokenizer writes it (its own tokens for the text); done once the output is a whole choice
    that no other choice continues."""
    written = [tokenizer(c, add_special_tokens=False).input_ids for c in CHOICES]
    out: list[int] = []
    while not (out in written and not any(w[: len(out)] == out != w for w in written)):
        allowed = {w[len(out)] for w in written if len(w) > len(out) and w[: len(out)] == out}
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
        out.append(max(allowed, key=lambda t: logits[t].item()))
    return out


def prompts(tokenizer) -> list[list[int]]:
    texts = ["def f(x):", "import os\n", "class A:", "# the answer is"]
    return [tokenizer(t).input_ids for t in texts]


def test_a_choice_is_greedy_among_the_tokens_that_keep_it_possible(engine, tokenizer, hf) -> None:
    choice = SamplingSettings(20, 0, structured_output=("choice", json.dumps(CHOICES)))
    results = run(engine, [(p, choice) for p in prompts(tokenizer)])
    for prompt, (tokens, text, reason) in zip(prompts(tokenizer), results, strict=True):
        assert tokens == hf_choice_greedy(hf, tokenizer, prompt)
        assert text in CHOICES and reason == "stop"
    assert len({text for _, text, _ in results}) > 1  # the logits, not the grammar, chose


def test_regex_and_json_schema_hold_and_plain_requests_beside_them_do_not_change(
    engine, tokenizer, hf
) -> None:
    regex = r"[0-9]{3}-[a-z]{2,4}"
    asked = [
        SamplingSettings(30, 0, structured_output=("regex", regex)),
        SamplingSettings(40, 0, structured_output=("json", json.dumps(SCHEMA))),
        SamplingSettings(40, 0.8, seed=3, structured_output=("json", json.dumps(SCHEMA))),
        SamplingSettings(8, 0, ignore_eos=True),
    ]
    prompt = prompts(tokenizer)
    results = run(engine, list(zip(prompt, asked, strict=True)))
    (_, text, reason) = results[0]
    assert re.fullmatch(regex, text) and reason == "stop"
    for _, text, reason in results[1:3]:
        value = json.loads(text)
        assert value["color"] in ("red", "green", "blue") and 0 <= value["n"] <= 99
        assert set(value) == {"color", "n"} and text == json.dumps(value)  # compact separators
        assert reason == "stop"
    with torch.inference_mode():
        plain = hf.generate(
            torch.tensor([prompt[3]]), max_new_tokens=8, do_sample=False, eos_token_id=None
        )[0, len(prompt[3]) :].tolist()
    assert results[3][0] == plain


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("regex", "(", "unclosed group"),
        ("json", "{not json", "not a JSON schema in JSON"),
        ("json", "[1]", "a JSON schema is an object"),
        ("choice", "[]", "choices are a list of non-empty strings"),
        ("grammar", "start: undefined_rule", "undefined_rule"),
        ("yaml", "a: 1", "must be .kind, spec text. with a kind of json, regex"),
    ],
)
def test_a_constraint_that_cannot_be_compiled_is_the_requests_error(
    engine, kind, spec, message
) -> None:
    with pytest.raises(RequestError, match=message) as refused:
        engine.add_request([5, 6], SamplingSettings(4, 0, structured_output=(kind, spec)))
    assert refused.value.field == "structured_output"
    assert not engine.has_unfinished()


def test_refused_without_a_tokenizer_and_when_the_graph_samples(checkpoint) -> None:
    app = from_pretrained(checkpoint, NeuronConfig(**SETTINGS))
    app.to_cpu()
    settings = SamplingSettings(4, 0, structured_output=("regex", "[a-z]+"))
    with pytest.raises(RequestError, match="need the engine's tokenizer"):
        Engine(app).add_request([5, 6], settings)
    sampling = {"on_device_sampling_config": OnDeviceSamplingConfig(dynamic=True)}
    app = from_pretrained(checkpoint, NeuronConfig(**(SETTINGS | sampling)))
    app.to_cpu()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    with pytest.raises(RequestError, match="structured_output adjusts the logits"):
        Engine(app, tokenizer).add_request([5, 6], settings)
