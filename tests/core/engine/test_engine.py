"""The serving engine (continuous batching over cache lines) against HF transformers.

Every greedy request must get the tokens HF's ``generate()`` gives its prompt alone, whatever
else runs beside it, eager and compiled, with and without async mode.
"""

from __future__ import annotations

import heapq
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nxdplug import (
    HuggingFaceGenerationAdapter,
    NeuronConfig,
    OnDeviceSamplingConfig,
    from_pretrained,
)
from nxdplug.engine import Engine, EngineFullError, RequestError, SamplingSettings
from nxdplug.engine.cache_space import CacheLines
from nxdplug.errors import ConfigError, NotSupportedError
from nxdplug.hookspecs import hookimpl
from nxdplug.testing import temporary_plugin
from nxdplug.types import Feature, KVCacheStrategy
from tests.core.runtime.test_application import left_padded

LENGTHS = (3, 7, 12, 5, 9, 4, 14)
MAX_TOKENS = (10, 4, 8, 12, 6, 9, 5)
SETTINGS = {
    "torch_dtype": "float32",
    "is_continuous_batching": True,
    "batch_size": 4,
    "seq_len": 64,
    "max_context_length": 16,
}
DYNAMIC = {"on_device_sampling_config": OnDeviceSamplingConfig(dynamic=True, global_topk=32)}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama", seed=1, initializer_range=0.15)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 500, (n,), generator=generator).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def solo(checkpoint, prompts) -> list[list[int]]:
    """HF transformers' greedy tokens for each prompt alone (no EOS stop)."""
    hf = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    outputs = []
    with torch.inference_mode():
        for prompt, count in zip(prompts, MAX_TOKENS, strict=True):
            tokens = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=count,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outputs.append(tokens[0, len(prompt) :].tolist())
    return outputs


def app_for(checkpoint, **settings):
    app = from_pretrained(checkpoint, NeuronConfig(**(SETTINGS | settings)))
    app.to_cpu()
    return app


def serve_all(engine: Engine, prompts, arrive_every: int = 0, **settings) -> dict[str, list[int]]:
    """Run every prompt through ``engine``; with ``arrive_every`` > 0 one request arrives per
    that many steps (so requests join and leave while others decode). Returns the tokens by
    request id, in prompt order."""
    order, tokens = [], {}
    queue = list(zip(prompts, MAX_TOKENS, strict=True))
    steps = 0
    while queue or engine.has_unfinished():
        while queue and (arrive_every == 0 or steps % arrive_every == 0):
            prompt, count = queue.pop(0)
            order.append(engine.add_request(prompt, SamplingSettings(count, 0, **settings)))
            if arrive_every:
                break
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
        steps += 1
    return {request: tokens[request] for request in order}


def test_the_greedy_paths_vary(solo) -> None:
    varied = [tokens for tokens in solo if len(set(tokens)) > len(tokens) // 2]
    assert len(varied) >= len(solo) - 2


@pytest.mark.parametrize("ctx_batch_size", [1, 3])
@pytest.mark.parametrize("arrive_every", [0, 2])
def test_each_request_gets_its_solo_greedy_tokens(
    checkpoint, prompts, solo, ctx_batch_size, arrive_every
) -> None:
    engine = Engine(app_for(checkpoint, ctx_batch_size=ctx_batch_size), eos_token_ids=[])
    assert list(serve_all(engine, prompts, arrive_every).values()) == solo
    assert engine.lines.in_use == 0 and not engine.has_unfinished()


def test_async_mode_with_on_device_sampling_gives_the_same_tokens(
    checkpoint, prompts, solo
) -> None:
    app = app_for(checkpoint, async_mode=True, **DYNAMIC)
    engine = Engine(app, eos_token_ids=[])
    assert engine.async_mode
    assert list(serve_all(engine, prompts, arrive_every=3).values()) == solo
    assert engine.lines.in_use == 0
    engine.close()


def test_async_mode_lets_a_late_request_join_at_once(checkpoint, prompts) -> None:
    """A request arriving while others decode is decoded beside them, not after them."""
    engine = Engine(app_for(checkpoint, async_mode=True, **DYNAMIC), eos_token_ids=[])
    early = [engine.add_request(p, SamplingSettings(40, 0)) for p in prompts[:2]]
    for _ in range(3):
        engine.step()
    late = engine.add_request(prompts[2], SamplingSettings(5, 0))
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == [late, *early]
    engine.close()


def test_async_mode_keeps_the_model_on_the_stepping_thread(
    checkpoint, prompts, solo, monkeypatch
) -> None:
    """The model runs on the thread that steps the engine (the one that loaded it); the host's
    handling of a step runs on the helper thread while the model makes the next."""
    app = app_for(checkpoint, async_mode=True, **DYNAMIC)
    model_threads, host_threads = set(), set()

    class Runner:
        def run(self, step):
            model_threads.add(threading.current_thread().name)
            return app.run(step)

    engine = Engine(app, eos_token_ids=[], runner=Runner())
    accept = engine._accept

    def recording_accept(batch, result):
        host_threads.add(threading.current_thread().name)
        return accept(batch, result)

    monkeypatch.setattr(engine, "_accept", recording_accept)
    assert list(serve_all(engine, prompts).values()) == solo
    engine.close()
    assert model_threads == {threading.current_thread().name}
    helpers = host_threads - {threading.current_thread().name}
    assert helpers and all(name.startswith("nxdplug-host") for name in helpers)


def test_generate_in_async_mode_handles_each_step_beside_the_next(
    checkpoint, prompts, solo
) -> None:
    """``generate()`` with async_mode: the model's calls on the caller's thread, the streamer
    fed on the helper thread; an EOS stop lets one step run ahead, which is dropped."""
    app = app_for(checkpoint, async_mode=True, **DYNAMIC)
    model_threads, streamer_threads = [], []

    class Streamer:
        def put(self, value: torch.Tensor) -> None:
            streamer_threads.append(threading.current_thread().name)

        def end(self) -> None:
            pass

    adapter = HuggingFaceGenerationAdapter(
        app,
        input_capture_hook=lambda model, inputs: model_threads.append(
            threading.current_thread().name
        ),
    )
    prompt, expected = prompts[0], solo[0]
    stop_at = next(i for i in range(2, len(expected)) if expected[i] not in expected[:i])
    output = adapter.generate(
        torch.tensor([prompt]),
        max_new_tokens=len(expected),
        eos_token_id=expected[stop_at],
        pad_token_id=0,
        streamer=Streamer(),
    )
    assert output[0, len(prompt) :].tolist() == expected[: stop_at + 1]
    assert model_threads == [threading.current_thread().name] * (stop_at + 2)
    assert any(name.startswith("nxdplug-host") for name in streamer_threads)


class TwoTopLines(CacheLines):
    """A third party's cache space: the highest free line first, and room for 2 requests."""

    reserved: list[tuple[int, int]] = []
    most_in_use = 0

    def reserve(self, prompt_ids, max_tokens, salt=None, reuse=True):
        if self.in_use == 2:
            return None
        line = max(self._free)
        self._free.remove(line)
        heapq.heapify(self._free)
        TwoTopLines.reserved.append((len(prompt_ids), max_tokens))
        TwoTopLines.most_in_use = max(TwoTopLines.most_in_use, self.in_use)
        return line

    def step_inputs(self, lines, device):
        assert all(line >= self.count - 2 for line in lines)
        return {}


class TwoTopLinesPlugin:
    @hookimpl
    def nxdplug_features(self):
        yield Feature(name="two-top-lines", settings={"two_top_lines": False})

    @hookimpl
    def nxdplug_kv_cache_strategies(self):
        yield KVCacheStrategy(
            name="two-top-lines",
            implementation="nxdplug.plugins.static_kv_cache.cache:StaticKVCache",
            cache_space=f"{__name__}:TwoTopLines",
            enabled_by=("two_top_lines",),
        )


def test_the_kv_cache_strategy_lends_the_room(plugin_manager, checkpoint, prompts, solo) -> None:
    """The engine asks the selected KV-cache strategy's cache space for room: a request waits
    while it has none, though lines are free, and runs in the line it lends."""
    with temporary_plugin(TwoTopLinesPlugin(), "two-top-lines"):
        engine = Engine(app_for(checkpoint, two_top_lines=True), eos_token_ids=[])
        assert isinstance(engine.lines, TwoTopLines)
        assert list(serve_all(engine, prompts).values()) == solo
    assert TwoTopLines.most_in_use == 2 and engine.lines.in_use == 0
    assert TwoTopLines.reserved == [(len(p), n) for p, n in zip(prompts, MAX_TOKENS, strict=True)]


@pytest.mark.parametrize(
    "settings", [{}, {"async_mode": True, **DYNAMIC}], ids=["host", "on-device-async"]
)
def test_generate_with_more_rows_than_lines_gives_hf_batched_output(
    checkpoint, prompts, solo, settings
):
    """7 rows on a cache of 4 lines: generate() runs them through the engine and returns what
    HF's generate() gives the same left-padded batch (rows ending at EOS, then padded)."""
    ids, mask = left_padded(prompts)
    eos = solo[0][3]
    assert sum(eos in tokens[:11] for tokens in solo) >= 2  # rows end at different steps
    common = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": eos, "pad_token_id": 0}
    hf = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.inference_mode():
        expected = hf.generate(ids, attention_mask=mask, **common)
    app = app_for(checkpoint, **settings)
    assert app.neuron_config.max_batch_size < len(prompts)
    ours = HuggingFaceGenerationAdapter(app).generate(ids, attention_mask=mask, **common)
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("sampling", [{}, DYNAMIC], ids=["host", "on-device"])
def test_sampled_rows_on_the_engine_follow_the_global_seed(checkpoint, prompts, sampling) -> None:
    ids, mask = left_padded(prompts)
    adapter = HuggingFaceGenerationAdapter(app_for(checkpoint, **sampling))
    common = {"max_new_tokens": 6, "do_sample": True, "top_k": 5, "eos_token_id": None}
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(adapter.generate(ids, attention_mask=mask, **common))
    greedy = adapter.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None)
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], greedy)


def test_generate_on_the_engine_applies_hfs_per_row_processors(checkpoint, prompts, solo):
    """repetition_penalty, min_new_tokens and a one-token sequence_bias, each row in the engine
    with its own: the same tokens as HF's generate() on the whole batch."""
    ids, mask = left_padded(prompts)
    eos = solo[0][3]
    common = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": eos, "pad_token_id": 0}
    processors = {
        "repetition_penalty": 1.6,
        "min_new_tokens": 6,
        "sequence_bias": [[[solo[1][0]], -100.0]],
    }
    hf = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.inference_mode():
        plain = hf.generate(ids, attention_mask=mask, **common)
        expected = hf.generate(ids, attention_mask=mask, **common, **processors)
    assert not torch.equal(plain, expected)
    adapter = HuggingFaceGenerationAdapter(app_for(checkpoint))
    ours = adapter.generate(ids, attention_mask=mask, **common, **processors)
    assert torch.equal(ours, expected)


def test_generate_refuses_on_the_engine_what_it_would_ignore(checkpoint, prompts) -> None:
    ids, mask = left_padded(prompts)
    adapter = HuggingFaceGenerationAdapter(app_for(checkpoint))
    with pytest.raises(NotSupportedError, match="NoRepeatNGramLogitsProcessor need every row"):
        adapter.generate(ids, attention_mask=mask, max_new_tokens=4, no_repeat_ngram_size=2)
    with pytest.raises(NotSupportedError, match="SequenceBiasLogitsProcessor need every row"):
        adapter.generate(ids, attention_mask=mask, max_new_tokens=4, sequence_bias=[[[5, 6], 2.0]])


@pytest.fixture(scope="module")
def compiled_folder(checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine") / "compiled"
    app = from_pretrained(checkpoint, NeuronConfig(**compiled_settings()))
    app.compile(folder, quiet=True)
    return folder


def compiled_settings(**more):
    buckets = {"enable_bucketing": True, "context_encoding_buckets": [8, 16]}
    buckets["token_generation_buckets"] = [32, 64]
    return SETTINGS | DYNAMIC | buckets | {"ctx_batch_size": 2} | more


@pytest.mark.parametrize("async_mode", [False, True])
def test_compiled_engine_with_buckets(checkpoint, compiled_folder, prompts, solo, async_mode):
    """Requests come and go on the compiled graphs (two buckets per phase); async mode is a
    runtime setting, so both load the same compiled folder."""
    app = from_pretrained(checkpoint, NeuronConfig(**compiled_settings(async_mode=async_mode)))
    app.load(compiled_folder, quiet=True)
    assert app.backend_name == "inductor"
    engine = Engine(app, eos_token_ids=[])
    assert list(serve_all(engine, prompts, arrive_every=2).values()) == solo
    assert engine.lines.in_use == 0
    engine.close()


def test_seeded_sampling_does_not_depend_on_the_batch(checkpoint, prompts) -> None:
    engine = Engine(app_for(checkpoint), eos_token_ids=[])
    sampled = {"temperature": 0.9, "top_k": 50, "top_p": 0.9, "seed": 7}

    def run(others: int) -> list[int]:
        first = engine.add_request(prompts[0], SamplingSettings(20, **sampled))
        for prompt in prompts[1 : 1 + others]:
            engine.add_request(prompt, SamplingSettings(20, temperature=1.0))
        tokens = {}
        while engine.has_unfinished():
            for output in engine.step():
                tokens.setdefault(output.request_id, []).extend(output.token_ids)
        return tokens[first]

    alone, crowded = run(0), run(3)
    assert alone == crowded
    engine.add_request(prompts[0], SamplingSettings(20, **(sampled | {"seed": 8})))
    other = []
    while engine.has_unfinished():
        other += [t for output in engine.step() for t in output.token_ids]
    assert other != alone


def test_stop_conditions(checkpoint, prompts, solo) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    eos = solo[0][3]
    first_eos = solo[0].index(eos)
    engine = Engine(app_for(checkpoint), tokenizer, eos_token_ids=[eos])

    def finish(**settings):
        request = engine.add_request(prompts[0], SamplingSettings(10, 0, **settings))
        tokens, text, last = [], "", None
        while engine.has_unfinished():
            for output in engine.step():
                assert output.request_id == request
                tokens += output.token_ids
                text += output.text
                last = output
        return tokens, text, last

    tokens, _, last = finish()
    assert tokens == solo[0][: first_eos + 1] and last.finish_reason == "stop"
    tokens, _, last = finish(ignore_eos=True)
    assert tokens == solo[0] and last.finish_reason == "length"
    assert last.completion_tokens == 10 and last.prompt_tokens == len(prompts[0])
    tokens, _, last = finish(ignore_eos=True, stop_token_ids=[solo[0][1]])
    assert tokens == solo[0][:2] and last.finish_reason == "stop"

    full_text = tokenizer.decode(solo[0], skip_special_tokens=True)
    _, text, _ = finish(ignore_eos=True)
    assert text == full_text
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    tokens, text, last = finish(ignore_eos=True, stop=[stop])
    assert stop.strip() and text == full_text[: full_text.index(stop)]
    assert last.finish_reason == "stop" and len(tokens) < 10


def test_logprobs_are_the_chosen_tokens_log_softmax(checkpoint, prompts, solo) -> None:
    app = app_for(checkpoint)
    engine = Engine(app, eos_token_ids=[])
    engine.add_request(prompts[1], SamplingSettings(4, 0, logprobs=True))
    logprobs = []
    while engine.has_unfinished():
        logprobs += [lp for output in engine.step() for lp in output.logprobs]
    hf = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompts[1] + solo[1]])).logits[0].log_softmax(-1)
    start = len(prompts[1]) - 1
    expected = [logits[start + i, token].item() for i, token in enumerate(solo[1])]
    assert logprobs == pytest.approx(expected, abs=1e-4)


def test_abort_frees_the_line(checkpoint, prompts) -> None:
    engine = Engine(app_for(checkpoint, batch_size=2), eos_token_ids=[])
    running = [engine.add_request(p, SamplingSettings(30, 0)) for p in prompts[:2]]
    waiting = engine.add_request(prompts[2], SamplingSettings(30, 0))
    engine.step()
    assert engine.lines.in_use == 2 and engine.num_waiting == 1
    engine.abort(waiting)
    engine.abort(running[0])
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs[waiting].finish_reason == "abort" and outputs[running[0]].finished
    assert outputs[running[0]].finish_reason == "abort"
    assert engine.lines.in_use == 1 and engine.num_waiting == 0
    engine.abort(running[1])
    engine.step()
    assert engine.lines.in_use == 0 and not engine.has_unfinished()


def test_queue_limit(checkpoint, prompts) -> None:
    engine = Engine(app_for(checkpoint), max_waiting=2)
    engine.add_request(prompts[0])
    engine.add_request(prompts[1])
    with pytest.raises(EngineFullError, match="2 requests are waiting"):
        engine.add_request(prompts[2])


@pytest.mark.parametrize(
    ("prompt", "settings", "field", "message"),
    [
        ([1] * 17, {}, "prompt", "at most 16 \\(max_context_length\\)"),
        ([1] * 10, {"max_tokens": 60}, "max_tokens", "ask for at most 54 tokens"),
        ([1, 2], {"temperature": -1.0}, "temperature", "must be in \\[0, 100\\]"),
        ([1, 2], {"top_p": 0.0}, "top_p", "must be in \\(0, 1\\]"),
        ([], {}, "prompt", "the prompt is empty"),
        ([1, 10**6], {}, "prompt", "outside the vocabulary"),
        ([1, 2], {"stop": ["x"]}, "stop", "need the engine's tokenizer"),
    ],
)
def test_bad_requests_are_refused(checkpoint, prompt, settings, field, message) -> None:
    engine = Engine(app_for(checkpoint))
    with pytest.raises(RequestError, match=message) as caught:
        engine.add_request(prompt, SamplingSettings(**settings))
    assert caught.value.field == field
    assert not engine.has_unfinished()


def test_on_device_sampling_refuses_what_it_cannot_honour(checkpoint) -> None:
    fixed = OnDeviceSamplingConfig(do_sample=True, top_k=5, temperature=0.7)
    engine = Engine(app_for(checkpoint, on_device_sampling_config=fixed))
    with pytest.raises(RequestError, match="dynamic=True") as caught:
        engine.add_request([1, 2], SamplingSettings(temperature=1.0))
    assert caught.value.field == "temperature"
    engine.add_request([1, 2], SamplingSettings(temperature=0.7, top_k=5))
    dynamic = Engine(app_for(checkpoint, **DYNAMIC))
    with pytest.raises(RequestError, match="one random stream") as caught:
        dynamic.add_request([1, 2], SamplingSettings(seed=3))
    with pytest.raises(RequestError, match="global_topk=32"):
        dynamic.add_request([1, 2], SamplingSettings(top_k=40))
    with pytest.raises(RequestError, match="output_logits=True"):
        dynamic.add_request([1, 2], SamplingSettings(logprobs=True))


def test_engine_needs_continuous_batching(checkpoint) -> None:
    with pytest.raises(ConfigError, match="is_continuous_batching=True"):
        Engine(app_for(checkpoint, is_continuous_batching=False))


@pytest.mark.parametrize("compiled", [False, True])
def test_generate_in_async_mode_matches_hf(checkpoint, compiled_folder, prompts, solo, compiled):
    """``generate()`` with async_mode: the next step runs while the host handles the last."""
    app = from_pretrained(checkpoint, NeuronConfig(**compiled_settings(async_mode=True)))
    if compiled:
        app.load(compiled_folder, quiet=True)
    else:
        app.to_cpu()
    calls = []
    adapter = HuggingFaceGenerationAdapter(
        app, input_capture_hook=lambda model, inputs: calls.append(inputs[0].shape)
    )
    for prompt, expected in zip(prompts[:2], solo[:2], strict=True):
        calls.clear()
        output = adapter.generate(
            torch.tensor([prompt]), max_new_tokens=len(expected), eos_token_id=None
        )
        assert output[0, len(prompt) :].tolist() == expected
        assert len(calls) == len(expected)
