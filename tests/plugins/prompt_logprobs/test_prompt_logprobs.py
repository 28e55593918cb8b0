"""Prompt log-probabilities (``enable_prompt_logprobs``) against HF transformers' log-softmax of
its own logits for the same prompt, through ``forward`` and through the engine, eager and
compiled; the generated tokens stay HF's greedy ones."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nxdplug import NeuronConfig, OnDeviceSamplingConfig, from_pretrained
from nxdplug.engine import Engine, RequestError, SamplingSettings
from nxdplug.errors import ConfigError, NotSupportedError
from nxdplug.testing import fresh_plugin_manager
from tests.core.runtime.test_application import left_padded

LENGTHS = (6, 11, 3, 9)
SETTINGS = {
    "torch_dtype": "float32",
    "is_continuous_batching": True,
    "batch_size": 2,
    "seq_len": 32,
    "max_context_length": 16,
    "enable_prompt_logprobs": True,
}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama", seed=3, initializer_range=0.15)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(3, 500, (n,), generator=generator).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def hf(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval()


def hf_scores(hf, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's log-probability of each prompt token after the ones before it (from the second
    token on), and the whole [tokens - 1, vocab] log-softmax that predicts them."""
    with torch.inference_mode():
        logprobs = hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    return logprobs.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0], logprobs


def hf_greedy(hf, prompt: list[int], count: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=count, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_forward_scores_each_left_padded_prompt_as_hf(checkpoint, prompts, hf) -> None:
    app = from_pretrained(checkpoint, NeuronConfig(**SETTINGS))
    app.to_cpu()
    rows = prompts[:2]
    ids, mask = left_padded(rows)
    out = app(input_ids=ids, attention_mask=mask, prompt_logprobs=True)
    for row, prompt in enumerate(rows):
        expected, logprobs = hf_scores(hf, prompt)
        assert out.prompt_logprobs[row, 0].isnan()
        got = out.prompt_logprobs[row, 1 : len(prompt)]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        ranks = (logprobs > expected[:, None]).sum(-1) + 1
        assert out.prompt_ranks[row, 1 : len(prompt)].tolist() == ranks.tolist()
        top = logprobs.topk(20, dim=-1)
        assert torch.equal(out.prompt_top_ids[row, 1 : len(prompt)], top.indices)
        torch.testing.assert_close(out.prompt_top_logprobs[row, 1 : len(prompt)], top.values)
        with torch.inference_mode():
            last = hf(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(out.logits[row, 0], last, atol=1e-4, rtol=1e-4)
    assert ranks.min() >= 1 and ranks.unique().numel() > 1  # not all the likeliest


def serve(engine: Engine, requests: list[tuple[list[int], SamplingSettings]]):
    """Every request's outputs, in request order."""
    ids = [engine.add_request(prompt, settings) for prompt, settings in requests]
    outputs: dict[str, list] = {i: [] for i in ids}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id].append(output)
    return [outputs[i] for i in ids]


def check_engine_scores(engine: Engine, prompts, hf) -> None:
    """Scored and plain requests side by side: each gets HF's greedy tokens, and the scored
    ones HF's prompt scores on their first output only, ``k`` alternatives each."""
    asked = [2, None, 0, 5]
    requests = [
        (prompt, SamplingSettings(5, 0, prompt_logprobs=k))
        for prompt, k in zip(prompts, asked, strict=True)
    ]
    results = serve(engine, requests)
    assert len({t for outputs in results for o in outputs for t in o.token_ids}) > 4
    for (prompt, _), k, outputs in zip(requests, asked, results, strict=True):
        assert [t for o in outputs for t in o.token_ids] == hf_greedy(hf, prompt, 5)
        assert all(o.prompt_logprobs is None for o in outputs[1:])
        scores = outputs[0].prompt_logprobs
        if k is None:
            assert scores is None
            continue
        expected, logprobs = hf_scores(hf, prompt)
        assert scores[0] is None and len(scores) == len(prompt)
        assert [s.token for s in scores[1:]] == prompt[1:]
        got = torch.tensor([s.logprob for s in scores[1:]])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert [s.rank for s in scores[1:]] == ((logprobs > expected[:, None]).sum(-1) + 1).tolist()
        top = logprobs.topk(max(k, 1), dim=-1)
        for score, ids, values in zip(scores[1:], top.indices, top.values, strict=True):
            assert len(score.top) == k
            assert [t for t, _ in score.top] == ids[:k].tolist()
            assert [lp for _, lp in score.top] == pytest.approx(values[:k].tolist(), abs=1e-4)
    assert engine.lines.in_use == 0


def test_the_engine_scores_the_prompts_that_ask(checkpoint, prompts, hf) -> None:
    app = from_pretrained(checkpoint, NeuronConfig(**SETTINGS))
    app.to_cpu()
    check_engine_scores(Engine(app, eos_token_ids=[]), prompts, hf)


def test_the_compiled_scoring_phase(checkpoint, prompts, hf, tmp_path) -> None:
    """One more graph per context bucket, loaded from the folder like the others (one bucket
    of each phase: the prompts of 3 to 11 tokens are padded to 16)."""
    settings = SETTINGS | {"enable_bucketing": True, "context_encoding_buckets": [16]}
    settings |= {"token_generation_buckets": [32]}
    app = from_pretrained(checkpoint, NeuronConfig(**settings))
    app.compile(tmp_path, quiet=True)
    app = from_pretrained(checkpoint, NeuronConfig(**settings))
    app.load(tmp_path, quiet=True)
    assert app.backend_name == "inductor"
    assert "prompt_scoring_model" in {w.tag for w in app.models}
    check_engine_scores(Engine(app, eos_token_ids=[]), prompts, hf)


def test_without_the_setting_prompt_logprobs_are_refused(checkpoint, prompts) -> None:
    app = from_pretrained(
        checkpoint, NeuronConfig(**(SETTINGS | {"enable_prompt_logprobs": False}))
    )
    app.to_cpu()
    assert "prompt_scoring_model" not in {w.tag for w in app.models}
    with pytest.raises(NotSupportedError, match=r"enable_prompt_logprobs=True"):
        app(input_ids=torch.tensor([prompts[0]]), prompt_logprobs=True)
    engine = Engine(app, eos_token_ids=[])
    with pytest.raises(RequestError, match=r"--enable-prompt-logprobs") as refused:
        engine.add_request(prompts[0], SamplingSettings(4, 0, prompt_logprobs=1))
    assert refused.value.field == "prompt_logprobs"


def test_bad_values_and_settings_are_refused(checkpoint, prompts) -> None:
    app = from_pretrained(checkpoint, NeuronConfig(**SETTINGS))
    app.to_cpu()
    engine = Engine(app, eos_token_ids=[])
    for value in (-1, 21, 1.5, True):
        with pytest.raises(RequestError, match=r"prompt_logprobs must be in \[0, 20\]"):
            engine.add_request(prompts[0], SamplingSettings(4, 0, prompt_logprobs=value))
    app(input_ids=torch.tensor([prompts[0]]))
    with pytest.raises(Exception, match=r"prompt_logprobs=True is for a prompt's context"):
        app(
            input_ids=torch.tensor([[5]]),
            position_ids=torch.tensor([[len(prompts[0])]]),
            attention_mask=torch.ones(1, len(prompts[0]) + 1, dtype=torch.long),
            prompt_logprobs=True,
        )
    sampling = {"on_device_sampling_config": OnDeviceSamplingConfig(dynamic=True)}
    with pytest.raises(ConfigError, match=r"enable_prompt_logprobs: prompts are scored"):
        from_pretrained(checkpoint, NeuronConfig(**(SETTINGS | sampling)))


def test_unscored_requests_and_calls_read_none(checkpoint, prompts) -> None:
    """The plugin's names read None where nothing was asked: a setting, a request's output and
    forward()'s outputs; other names stay unknown attributes."""
    app = from_pretrained(checkpoint, NeuronConfig(**SETTINGS))
    app.to_cpu()
    assert SamplingSettings().prompt_logprobs is None
    assert SamplingSettings(prompt_logprobs=None) == SamplingSettings()
    out = app(input_ids=torch.tensor([prompts[0]]))
    assert out.prompt_logprobs is None and out.prompt_top_ids is None
    assert "prompt_logprobs" not in out
    with pytest.raises(AttributeError):
        _ = out.prompt_entropy
    engine = Engine(app, eos_token_ids=[])
    (outputs,) = serve(engine, [(prompts[0], SamplingSettings(1, 0))])
    assert outputs[0].prompt_logprobs is None
    with pytest.raises(AttributeError):
        _ = outputs[0].prompt_entropy
    with pytest.raises(RequestError, match=r"max_tokenz: no sampling setting") as refused:
        engine.add_request(prompts[0], SamplingSettings(max_tokenz=3))
    assert refused.value.field == "max_tokenz"


def test_with_the_plugin_disabled_the_error_names_it(checkpoint, prompts) -> None:
    with fresh_plugin_manager(deny=frozenset({"prompt_logprobs"})):
        settings = {k: v for k, v in SETTINGS.items() if k != "enable_prompt_logprobs"}
        app = from_pretrained(checkpoint, NeuronConfig(**settings))
        app.to_cpu()
        engine = Engine(app, eos_token_ids=[])
        with pytest.raises(RequestError, match=r"NXDPLUG_DENY_PLUGINS disable: prompt_logprobs"):
            engine.add_request(prompts[0], SamplingSettings(4, 0, prompt_logprobs=1))
        (outputs,) = serve(engine, [(prompts[0], SamplingSettings(1, 0))])
        assert outputs[0].extra("prompt_logprobs") is None
        with pytest.raises(NotSupportedError, match=r"prompt_logprobs: no installed plugin"):
            app(input_ids=torch.tensor([prompts[0]]), prompt_logprobs=True)
