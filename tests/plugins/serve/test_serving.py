"""``nxdplug serve``: a real server process, driven by the official ``openai`` client.

Greedy outputs are checked against HF transformers' greedy decoding of the same checkpoint;
errors against OpenAI's error body; the load test and the client that hangs up against the
server's own metrics (every KV-cache line free afterwards).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from nxdplug.cli.main import main  # noqa: E402
from nxdplug.hookspecs import hookimpl  # noqa: E402
from nxdplug.plugins.serve.benchmark.server_process import free_port  # noqa: E402
from nxdplug.plugins.serve.protocol import ChatCompletionRequest, OpenAIError  # noqa: E402
from nxdplug.testing import temporary_plugin  # noqa: E402
from nxdplug.testing.tiny_models import make_tiny_checkpoint  # noqa: E402
from nxdplug.types import StructuredOutputBackend  # noqa: E402

SEQ_LEN = 512  # long enough that a 400-token stream outlasts a client that hangs up
MODEL = "tiny-llama"
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
STARTED = re.compile(r"at (https?://\S+)/v1 ")
SYS_TGKILL = 234  # Linux on x86-64: a signal to one thread of a process


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_checkpoint(
        "llama", tmp_path_factory.mktemp("serve") / "ckpt", seed=1,
        overrides={"initializer_range": 0.15},
    )  # fmt: skip
    return with_chat_template(path, CHAT_TEMPLATE)


def start_server(
    checkpoint: Path, *options: str, env: dict[str, str] | None = None, eager: bool = True
):
    """A ``nxdplug serve`` process on a free port, and its base URL once the start-up line is
    printed (None for a rank that does not serve). ``eager``: --enforce-eager (the tests of
    the API do not need graphs; compiling is tested on its own)."""
    command = [
        sys.executable, "-m", "nxdplug.cli.main",
        "serve", "--model-path", str(checkpoint), "--served-model-name", MODEL, "--port", "0",
        "--torch-dtype", "float32", "--log-level", "warning", *options,
        *(["--enforce-eager"] if eager else []),
    ]  # fmt: skip
    env = os.environ | {"HF_HUB_OFFLINE": "1"} | (env or {})
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    if env.get("RANK", "0") != "0":
        return process, None
    first_line = process.stdout.readline()
    match = STARTED.search(first_line)
    if not match:
        process.kill()
        pytest.fail(f"no start-up line: {first_line!r} {process.communicate()[1]}")
    return process, match.group(1)


def stop(processes: list[subprocess.Popen], sig: int = signal.SIGTERM) -> None:
    """Signal every process, as a terminal signals its process group; each must exit 0."""
    for process in processes:
        process.send_signal(sig)
    for process in processes:
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, stderr
        assert "Traceback" not in stderr, stderr


@contextlib.contextmanager
def running_server(checkpoint: Path, *options: str) -> Iterator[str]:
    """A ``nxdplug serve`` for the block; its base URL. Stopped with SIGTERM, which must exit
    0 (killed if the block fails)."""
    process, base = start_server(checkpoint, *options)
    try:
        yield base
        stop([process])
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def with_chat_template(checkpoint: Path, template: str) -> Path:
    """The checkpoint, its tokenizer given ``template`` as its chat template."""
    config_file = checkpoint / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(config | {"chat_template": template}))
    return checkpoint


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[str]:
    """A running ``nxdplug serve``; its base URL."""
    options = ("--seq-len", str(SEQ_LEN), "--batch-size", "4", "--enable-prompt-logprobs")
    with running_server(checkpoint, *options) as base:
        yield base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path):
    return AutoTokenizer.from_pretrained(str(checkpoint))


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def greedy(hf_model, tokenizer):
    """HF transformers' greedy text for prompt ids, ignoring EOS (the oracle), with HF's
    ``processors`` (``repetition_penalty=1.5``, ...) when given."""
    cache: dict[tuple[tuple[int, ...], int, str], str] = {}

    def decode(prompt_ids: list[int], max_tokens: int, **processors) -> str:
        key = (tuple(prompt_ids), max_tokens, repr(processors))
        if key not in cache:
            with torch.inference_mode():
                out = hf_model.generate(
                    torch.tensor([prompt_ids]),
                    max_new_tokens=max_tokens,
                    min_new_tokens=max_tokens,
                    do_sample=False,
                    pad_token_id=0,
                    **processors,
                )
            cache[key] = tokenizer.decode(out[0, len(prompt_ids) :], skip_special_tokens=True)
        return cache[key]

    return decode


def request(url: str, body: str | None = None) -> tuple[int, str]:
    """Status and body of a GET (or a JSON POST with ``body``), errors included."""
    data = None if body is None else body.encode()
    sent = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(sent, timeout=60) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def get(url: str) -> tuple[int, str]:
    return request(url)


def metric(base: str, name: str) -> float:
    text = get(f"{base}/metrics")[1]
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def wait_until_idle(base: str) -> None:
    names = (
        "nxdplug:kv_cache_lines_in_use",
        "nxdplug:num_requests_running",
        "nxdplug:num_requests_waiting",
    )
    for _ in range(100):
        if all(metric(base, name) == 0 for name in names):
            return
        time.sleep(0.05)
    pytest.fail(
        "the server did not free its KV-cache lines: " + str([metric(base, n) for n in names])
    )


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


# --- the OpenAI API --------------------------------------------------------------------------


def test_completion_is_hf_greedy(client, tokenizer, greedy) -> None:
    prompt = "def add(a, b):\n    return"
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True}, logprobs=0,
    )  # fmt: skip
    prompt_ids = tokenizer(prompt).input_ids
    choice = reply.choices[0]
    assert choice.text == greedy(prompt_ids, 12)
    assert choice.finish_reason == "length"
    assert reply.object == "text_completion" and reply.model == MODEL
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == 12 and reply.usage.total_tokens == len(prompt_ids) + 12
    assert len(choice.logprobs.token_logprobs) == 12
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)


def test_completion_of_token_ids_streamed(client, greedy) -> None:
    prompt_ids = [5, 17, 300, 42, 9, 120]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt_ids, max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert all(c.object == "text_completion" for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy(prompt_ids, 20)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_completion_is_hf_greedy(client, tokenizer, greedy) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "import os"},
    ]
    prompt_ids = chat_prompt_ids(tokenizer, messages)
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=15, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == greedy(prompt_ids, 15)
    assert reply.usage.prompt_tokens == len(prompt_ids)

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=15, temperature=0, stream=True,
            logprobs=True, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == greedy(prompt_ids, 15)
    assert sum(len(c.choices[0].logprobs.content) for c in chunks[1:]) == 15
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_without_max_tokens_fills_the_sequence(client, tokenizer) -> None:
    messages = [{"role": "user", "content": "x = 1"}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    prompt = len(chat_prompt_ids(tokenizer, messages))
    assert reply.usage.completion_tokens == SEQ_LEN - prompt
    assert reply.choices[0].finish_reason == "length"


def test_stop_string_ends_the_text_before_it(client, greedy, tokenizer) -> None:
    prompt_ids = [7, 8, 9, 10]
    full = greedy(prompt_ids, 12)
    stop = full[3:5]
    reply = client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=12, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.choices[0].text == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_penalties_and_logit_bias_are_hf_processors(client, hf_model, greedy) -> None:
    prompt_ids = [386, 268, 400, 356]  # whose greedy output repeats tokens
    plain = greedy(prompt_ids, 12)
    with torch.inference_mode():
        banned = int(hf_model(torch.tensor([prompt_ids])).logits[0, -1].argmax())
    cases = [
        ({"extra_body": {"repetition_penalty": 1.6}}, {"repetition_penalty": 1.6}),
        ({"logit_bias": {str(banned): -100}}, {"sequence_bias": [[[banned], -100.0]]}),
    ]
    for ours, theirs in cases:
        ours["extra_body"] = ours.get("extra_body", {}) | {"ignore_eos": True}
        reply = client.completions.create(
            model=MODEL, prompt=prompt_ids, max_tokens=12, temperature=0, **ours
        )
        expected = greedy(prompt_ids, 12, **theirs)
        assert reply.choices[0].text == expected and expected != plain, ours


def test_top_logprobs_list_the_likeliest_tokens(client) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "import sys"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = reply.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        values = [top.logprob for top in item.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert item.top_logprobs[0].token == item.token  # greedy: the likeliest
        assert values[0] == pytest.approx(item.logprob)
        assert item.top_logprobs[0].bytes == list(item.token.encode())
    reply = client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=5, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.top_logprobs) == 5
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert 1 <= len(top) <= 2 and top[token] == pytest.approx(logprob)
        assert max(top.values()) == pytest.approx(logprob)


def hf_prompt_scores(hf_model, prompt_ids: list[int]) -> tuple[list[float], torch.Tensor]:
    """HF's log-probability of each prompt token after the ones before it (from the second
    on), and the [tokens - 1, vocab] log-softmax predicting them."""
    with torch.inference_mode():
        logprobs = hf_model(torch.tensor([prompt_ids])).logits[0, :-1].float().log_softmax(-1)
    chosen = logprobs.gather(-1, torch.tensor(prompt_ids[1:])[:, None])[:, 0]
    return chosen.tolist(), logprobs


def test_echo_with_logprobs_scores_the_prompt_as_hf(client, tokenizer, hf_model, greedy) -> None:
    """lm-evaluation-harness's loglikelihood request: the prompt's tokens, with HF's
    log-probabilities, before the completion's, which are those of a request without echo."""
    prompt = "def add(a, b):\n    return"
    prompt_ids = tokenizer(prompt).input_ids
    asked = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2}
    asked["extra_body"] = {"ignore_eos": True}
    echoed = client.completions.create(**asked, echo=True).choices[0]
    plain = client.completions.create(**asked).choices[0]
    assert echoed.text == prompt + greedy(prompt_ids, 4) == prompt + plain.text
    logprobs, n = echoed.logprobs, len(prompt_ids)
    assert logprobs.tokens == [tokenizer.decode([t]) for t in prompt_ids] + plain.logprobs.tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected, hf_logprobs = hf_prompt_scores(hf_model, prompt_ids)
    assert logprobs.token_logprobs[1:n] == pytest.approx(expected, abs=1e-4)
    for top, row in zip(logprobs.top_logprobs[1:n], hf_logprobs, strict=True):
        assert sorted(top.values(), reverse=True) == pytest.approx(row.topk(2).values.tolist())
    assert logprobs.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs)
    for top, plain_top in zip(logprobs.top_logprobs[n:], plain.logprobs.top_logprobs, strict=True):
        assert top == pytest.approx(plain_top)
    assert logprobs.text_offset[n:] == [len(prompt) + o for o in plain.logprobs.text_offset]


def test_echo_streams_the_prompt_first(client, tokenizer, greedy) -> None:
    """Echo without logprobs needs no scores; token-id prompts echo as their text; two prompts
    with two choices each echo their own prompt."""
    prompts = [[5, 17, 300, 42], [9, 120, 7]]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2, echo=True,
            stream=True, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    texts = ["", "", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            if not texts[choice.index]:
                assert choice.text.startswith(tokenizer.decode(prompts[choice.index // 2]))
            texts[choice.index] += choice.text
    assert texts == [tokenizer.decode(p) + greedy(p, 5) for p in prompts for _ in range(2)]


def test_vllm_prompt_logprobs_in_a_chat(client, tokenizer, hf_model, greedy) -> None:
    """vLLM's prompt_logprobs: at each prompt position the prompt's token (its rank among the
    vocabulary) and the k likeliest, by token id, as HF scores them."""
    messages = [{"role": "user", "content": "import os"}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0,
        extra_body={"ignore_eos": True, "prompt_logprobs": 3},
    )  # fmt: skip
    prompt_ids = chat_prompt_ids(tokenizer, messages)
    assert reply.choices[0].message.content == greedy(prompt_ids, 3)
    positions = reply.choices[0].model_extra["prompt_logprobs"]
    expected, hf_logprobs = hf_prompt_scores(hf_model, prompt_ids)
    assert positions[0] is None and len(positions) == len(prompt_ids)
    for j, (entries, want, row) in enumerate(
        zip(positions[1:], expected, hf_logprobs, strict=True), start=1
    ):
        token = entries[str(prompt_ids[j])]
        assert token["logprob"] == pytest.approx(want, abs=1e-4)
        assert token["rank"] == int((row > row[prompt_ids[j]]).sum()) + 1
        assert token["decoded_token"] == tokenizer.decode([prompt_ids[j]])
        top = row.topk(3)
        for rank, (t, lp) in enumerate(
            zip(top.indices.tolist(), top.values.tolist(), strict=True), start=1
        ):
            assert entries[str(t)]["logprob"] == pytest.approx(lp, abs=1e-4)
            assert entries[str(t)]["rank"] == rank
        assert len(entries) in (3, 4)
    completion = client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=1, temperature=0,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    positions = completion.choices[0].model_extra["prompt_logprobs"]
    assert [list(p) for p in positions[1:]] == [[str(t)] for t in prompt_ids[1:]]


THING = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "maximum": 30}},
    "required": ["kind", "age"],
    "additionalProperties": False,
}


def test_structured_outputs_through_the_openai_client(client) -> None:
    """OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs and
    guided_* fields, streamed and not."""
    messages = [{"role": "user", "content": "a pet"}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": THING}}
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0, response_format=schema_format
    )
    pet = json.loads(reply.choices[0].message.content)
    assert pet["kind"] in ("cat", "dog") and 0 <= pet["age"] <= 30 and set(pet) == {"kind", "age"}
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0, stream=True,
        response_format=schema_format,
    )  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content
    reply = client.completions.create(
        model=MODEL, prompt="colour:", max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"choice": ["red", "blue", "dark green"]}},
    )  # fmt: skip
    assert reply.choices[0].text in ("red", "blue", "dark green")
    assert reply.choices[0].finish_reason == "stop"
    reply = client.completions.create(
        model=MODEL, prompt="year:", max_tokens=10, temperature=0.9, seed=1,
        extra_body={"guided_regex": "(19|20)[0-9]{2}"},
    )  # fmt: skip
    assert re.fullmatch("(19|20)[0-9]{2}", reply.choices[0].text)
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert text.startswith("{") and (finish == "length" or isinstance(json.loads(text), dict))


def test_n_choices_are_each_a_sample_and_seeded_apart(server: str, client, greedy) -> None:
    prompt_ids = [11, 12, 13]
    common = {"model": MODEL, "prompt": prompt_ids, "max_tokens": 8}
    common["extra_body"] = {"ignore_eos": True}
    reply = client.completions.create(**common, n=3, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert {c.text for c in reply.choices} == {greedy(prompt_ids, 8)}
    assert reply.usage.prompt_tokens == 3 and reply.usage.completion_tokens == 24

    sampled = client.completions.create(**common, n=4, temperature=1.0, seed=9)
    texts = [c.text for c in sampled.choices]
    assert len(set(texts)) > 1  # each choice samples on its own
    again = client.completions.create(**common, n=4, temperature=1.0, seed=9)
    assert [c.text for c in again.choices] == texts
    # choice i is seeded seed + i, as vLLM seeds them
    shifted = client.completions.create(**common, n=1, temperature=1.0, seed=10)
    assert shifted.choices[0].text == texts[1]

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=6, n=2,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    texts = {0: "", 1: ""}
    roles = []
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        roles += [choice.index] if choice.delta.role else []
    assert roles == [0, 1] and texts[0] == texts[1] and texts[0]
    assert chunks[-1].usage.completion_tokens == 12
    wait_until_idle(server)


def test_a_batch_of_prompts_gets_each_prompts_choices_in_order(client, greedy) -> None:
    prompts = [[5, 6, 7], [8, 9], [30, 31, 32, 33]]
    reply = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=5, n=2, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in reply.choices] == list(range(6))
    assert [c.text for c in reply.choices] == [greedy(p, 5) for p in prompts for _ in range(2)]
    assert reply.usage.prompt_tokens == 9 and reply.usage.completion_tokens == 30
    texts = ["a = 1", "import os"]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=texts, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    streamed = ["", ""]
    for chunk in chunks[:-1]:
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    single = [client.completions.create(
        model=MODEL, prompt=text, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    ) for text in texts]  # fmt: skip
    assert streamed == [r.choices[0].text for r in single]
    assert chunks[-1].usage.prompt_tokens == sum(r.usage.prompt_tokens for r in single)


def test_models_health_and_metrics(server: str, client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert get(f"{server}/health")[0] == 200
    text = get(f"{server}/metrics")[1]
    for name in (
        "nxdplug:num_requests_running",
        "nxdplug:num_requests_waiting",
        "nxdplug:kv_cache_lines_in_use",
        "nxdplug:prompt_tokens_total",
        "nxdplug:generation_tokens_total",
        "nxdplug:request_success_total",
        "nxdplug:time_to_first_token_seconds_bucket",
        "nxdplug:inter_token_latency_seconds_bucket",
        "nxdplug:e2e_request_latency_seconds_bucket",
    ):
        assert name in text
    assert metric(server, "nxdplug:kv_cache_lines_total") == 4
    before = metric(server, "nxdplug:generation_tokens_total")
    client.completions.create(
        model=MODEL, prompt=[1, 2], max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert metric(server, "nxdplug:generation_tokens_total") == before + 3


# --- errors ------------------------------------------------------------------------------------


def post(base: str, path: str, body: str | dict) -> tuple[int, dict]:
    status, text = request(f"{base}/v1/{path}", body if isinstance(body, str) else json.dumps(body))
    return status, json.loads(text)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "gpt-4", "prompt": "a"}, 404, "model"),
        ('{"model": "tiny-llama", "prompt": ', 400, None),
        ({"model": MODEL, "prompt": "a", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "a", "min_p": 2}, 400, "min_p"),
        ({"model": MODEL, "prompt": "a b " * 400}, 400, "prompt"),
        ({"model": MODEL, "prompt": "a", "max_tokens": SEQ_LEN}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "a", "n": 0}, 400, "n"),
        ({"model": MODEL, "prompt": "a", "n": 129}, 400, "n"),
        ({"model": MODEL, "prompt": [[1]] * 9, "n": 128}, 400, "n"),  # > the 1024 queue
        ({"model": MODEL, "prompt": "a", "logprobs": 21}, 400, "logprobs"),
        ({"model": MODEL, "prompt": "a", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
        (
            {
                "model": MODEL,
                "prompt": "a",
                "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
            },
            400,
            "response_format",
        ),
        (
            {"model": MODEL, "prompt": "a", "response_format": {"type": "xml"}},
            400,
            "response_format.type",
        ),
        (
            {"model": MODEL, "prompt": "a", "structured_outputs": {"regex": "("}},
            400,
            "structured_outputs",
        ),
        (
            {"model": MODEL, "prompt": "a", "guided_regex": "a", "guided_choice": ["a"]},
            400,
            "guided_choice",
        ),
        (
            {"model": MODEL, "prompt": "a", "prompt_logprobs": 1, "stream": True},
            400,
            "prompt_logprobs",
        ),
        ({"model": MODEL, "prompt": "a", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
        ({"model": MODEL, "prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ({"model": MODEL, "prompt": "a", "logit_bias": {"five": 10}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "a", "logit_bias": {"5": 101}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "a", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
        ({"model": MODEL, "prompt": "a", "best_of": 3}, 400, "best_of"),
        ({"model": MODEL, "prompt": "a", "made_up": 1}, 400, "made_up"),
        ({"model": MODEL, "prompt": ["a"] * 129}, 400, "prompt"),
        ({"model": MODEL, "prompt": [[1, 2], []]}, 400, "prompt"),
        ({"model": MODEL}, 400, "prompt"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_bad_completion_requests(server: str, body, status: int, param) -> None:
    code, reply = post(server, "completions", body)
    assert code == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    if status == 404:
        assert error["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        (
            {"messages": [{"role": "user", "content": "a", "tool_calls": []}]},
            "messages.0.tool_calls",
        ),
        ({"messages": []}, "messages"),
    ],
)
def test_bad_chat_requests(server: str, extra: dict, param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a"}]} | extra
    code, reply = post(server, "chat/completions", body)
    assert code == 400, reply
    assert reply["error"]["param"] == param


def test_tokenize_and_detokenize_as_vllm(server: str, tokenizer) -> None:
    """vLLM's ``/tokenize`` and ``/detokenize``: the ids a completion or a chat is given."""

    def call(path: str, body: dict) -> tuple[int, dict]:
        status, text = request(f"{server}/{path}", json.dumps(body))
        return status, json.loads(text)

    code, answer = call("tokenize", {"model": MODEL, "prompt": "def f(x):"})
    ids = tokenizer("def f(x):").input_ids
    assert code == 200 and answer == {"count": len(ids), "max_model_len": SEQ_LEN, "tokens": ids}
    messages = [{"role": "user", "content": "hi"}]
    code, answer = call("tokenize", {"messages": messages, "return_token_strs": True})
    assert answer["tokens"] == chat_prompt_ids(tokenizer, messages)
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])
    going_on = [*messages, {"role": "assistant", "content": "He said"}]
    asked = {"messages": going_on, "add_generation_prompt": False, "continue_final_message": True}
    code, answer = call("tokenize", asked)
    text = tokenizer.apply_chat_template(going_on, continue_final_message=True, tokenize=False)
    assert text.endswith("He said") and answer["tokens"] == tokenizer(text).input_ids
    assert call("detokenize", {"model": MODEL, "tokens": ids}) == (200, {"prompt": "def f(x):"})
    for path, body, status, param in [
        ("detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("tokenize", {"prompt": "a", "messages": messages}, 400, "prompt"),
        ("tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
        ("tokenize", {"messages": going_on, "continue_final_message": True}, 400,
         "continue_final_message"),
    ]:  # fmt: skip
        code, answer = call(path, body)
        assert code == status and answer["error"]["param"] == param, answer


def test_skip_special_tokens_false_keeps_them_in_the_text(client) -> None:
    """vLLM's ``skip_special_tokens``: ``<|endoftext|>`` (forced by a bias, EOS ignored) is
    text only when asked; an EOS that ends a request is never text."""
    forced = {"logit_bias": {"0": 100}, "max_tokens": 3, "temperature": 0}
    for skip, text in [(True, ""), (False, "<|endoftext|>" * 3)]:
        answer = client.completions.create(
            model=MODEL, prompt="a", **forced,
            extra_body={"ignore_eos": True, "skip_special_tokens": skip},
        )  # fmt: skip
        assert answer.choices[0].text == text
    ended = client.completions.create(
        model=MODEL, prompt="a", **forced, extra_body={"skip_special_tokens": False}
    )
    assert ended.choices[0].text == "" and ended.choices[0].finish_reason == "stop"


def test_a_chat_continues_its_last_message(client, tokenizer, greedy) -> None:
    messages = [
        {"role": "user", "content": "Write a function"},
        {"role": "assistant", "content": "def add(a, b):"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True,
                    "ignore_eos": True},
    )  # fmt: skip
    text = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    assert text.endswith("def add(a, b):") and answer.usage.prompt_tokens == len(prompt)
    assert answer.choices[0].message.content == greedy(prompt, 10)


def test_the_openai_client_sees_the_errors(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="a")
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="a", best_of=2)
    # ... and the server keeps serving
    assert (
        client.completions.create(model=MODEL, prompt="a", max_tokens=2).usage.completion_tokens
        >= 1
    )


def test_a_tokenizer_without_chat_template_is_a_clear_400(checkpoint: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    tokenizer.chat_template = None
    request = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "a"}])
    with pytest.raises(OpenAIError, match="no chat template") as raised:
        request.prompt_text(tokenizer)
    assert raised.value.status == 400


@pytest.mark.skipif(
    (sys.platform, platform.machine()) != ("linux", "x86_64"),
    reason="SYS_TGKILL is the x86-64 Linux system call number",
)
def test_a_stop_signal_to_any_thread_stops_the_server(checkpoint: Path) -> None:
    """The kernel may hand SIGTERM to any thread of the process (an HTTP or OpenMP one, under
    load), while Python's handler runs on the main thread, which an idle server keeps waiting:
    it must still stop (it waited forever, 2026-11-28)."""
    libc = ctypes.CDLL(None, use_errno=True)
    process, _ = start_server(checkpoint, "--seq-len", "64", "--batch-size", "2")
    try:
        time.sleep(0.5)  # idle
        others = [int(t) for t in os.listdir(f"/proc/{process.pid}/task") if int(t) != process.pid]
        assert others and libc.syscall(SYS_TGKILL, process.pid, others[-1], signal.SIGTERM) == 0
        _, stderr = process.communicate(timeout=30)
        assert process.returncode == 0 and "Traceback" not in stderr, stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_busy_port_is_a_one_line_error(server: str, checkpoint: Path, capsys) -> None:
    port = server.rsplit(":", 1)[1]
    code = main(["serve", "--model-path", str(checkpoint), "--port", port])
    assert code == 1
    error = capsys.readouterr().err
    assert (
        error.startswith("nxdplug: error: cannot listen on 127.0.0.1:") and "Traceback" not in error
    )


# --- load and cancellation ---------------------------------------------------------------------


def test_concurrent_clients_get_their_solo_greedy_outputs(server: str, client, greedy) -> None:
    generator = torch.Generator().manual_seed(0)
    jobs = [
        (torch.randint(3, 500, (3 + (i * 7) % 40,), generator=generator).tolist(), 2 + (i * 5) % 19)
        for i in range(64)
    ]
    expected = [greedy(prompt, max_tokens) for prompt, max_tokens in jobs]

    def ask(job: tuple[list[int], int]) -> str:
        prompt, max_tokens = job
        reply = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert reply.usage.completion_tokens == max_tokens
        return reply.choices[0].text

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, jobs))
    assert answers == expected
    wait_until_idle(server)


@pytest.mark.parametrize("choices", [1, 3])
def test_a_client_that_hangs_up_frees_its_line(server: str, client, choices: int) -> None:
    aborted = 'nxdplug:request_success_total{finished_reason="abort"}'
    text = get(f"{server}/metrics")[1]
    before = float(m.group(1)) if (m := re.search(re.escape(aborted) + r" (\S+)", text)) else 0.0
    stream = client.completions.create(
        model=MODEL, prompt=[1, 2, 3], max_tokens=SEQ_LEN - 3, temperature=0, stream=True,
        n=choices, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for count, _ in enumerate(stream):
        if count == 1:
            break
    stream.close()
    wait_until_idle(server)
    assert metric(server, aborted) == before + choices


def test_a_client_that_hangs_up_before_a_whole_answer_frees_its_line(server: str) -> None:
    """Not streamed: the server notices the closed connection while it waits for the answer."""
    aborted = 'nxdplug:request_success_total{finished_reason="abort"}'
    text = get(f"{server}/metrics")[1]
    before = float(m.group(1)) if (m := re.search(re.escape(aborted) + r" (\S+)", text)) else 0.0
    body = json.dumps(
        {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": SEQ_LEN - 3, "ignore_eos": True}
    ).encode()
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        for _ in range(100):  # until the request runs
            if metric(server, "nxdplug:num_requests_running") == 1:
                break
            time.sleep(0.02)
    wait_until_idle(server)
    assert metric(server, aborted) == before + 1


def test_a_request_waits_for_a_free_line(server: str, client) -> None:
    """Five requests on four lines: the fifth waits for a line, and all finish."""
    barrier = threading.Barrier(5)

    def ask(_: int) -> int:
        barrier.wait()
        reply = client.completions.create(
            model=MODEL, prompt=[4, 5], max_tokens=40, extra_body={"ignore_eos": True}
        )
        return reply.usage.completion_tokens

    with ThreadPoolExecutor(5) as pool:
        assert list(pool.map(ask, range(5))) == [40] * 5
    wait_until_idle(server)


# --- the engine thread, without HTTP -----------------------------------------------------------


@pytest.fixture(scope="module")
def application(checkpoint: Path):
    from nxdplug import NeuronConfig, from_pretrained

    neuron_config = NeuronConfig(
        batch_size=2, ctx_batch_size=1, is_continuous_batching=True, seq_len=64,
        torch_dtype="float32",
    )  # fmt: skip
    model = from_pretrained(checkpoint, neuron_config)
    model.to_cpu()
    return model


def _running(engine_loop) -> threading.Thread:
    """``engine_loop.run()`` on a thread of its own, as the server's main thread runs it."""
    stepper = threading.Thread(target=engine_loop.run, daemon=True)
    stepper.start()
    return stepper


@pytest.mark.filterwarnings("ignore:the model runs on thread:RuntimeWarning")  # the loop's thread
def test_engine_loop_streams_and_a_closed_stream_aborts(application) -> None:
    from nxdplug.engine import Engine, SamplingSettings
    from nxdplug.plugins.serve.engine_loop import EngineLoop, EngineStoppedError

    engine = Engine(application)
    engine_loop = EngineLoop(engine)
    stepper = _running(engine_loop)
    settings = SamplingSettings(max_tokens=40, temperature=0, ignore_eos=True)

    async def scenario() -> tuple[int, str | None]:
        whole = [o async for _, o in await engine_loop.generate([1, 2, 3], settings)]
        stream = await engine_loop.generate([1, 2, 3], settings)
        async for _ in stream:
            break  # the consumer leaves: the request is aborted
        return sum(len(o.token_ids) for o in whole), whole[-1].finish_reason

    assert asyncio.run(scenario()) == (40, "length")
    for _ in range(100):
        if engine.lines.in_use == 0 and not engine.has_unfinished():
            break
        time.sleep(0.01)
    assert engine.lines.in_use == 0 and not engine.has_unfinished()
    assert engine_loop.is_serving()
    engine_loop.stop()
    stepper.join(timeout=10)
    assert not stepper.is_alive() and not engine_loop.is_serving()

    async def after_stop() -> None:
        await engine_loop.generate([1], settings)

    with pytest.raises(EngineStoppedError):
        asyncio.run(after_stop())


@pytest.mark.filterwarnings("ignore:the model runs on thread:RuntimeWarning")  # the loop's thread
def test_engine_loop_wakes_the_event_loop_once_a_step(application) -> None:
    """Both rows' outputs of a step reach the event loop in one wake-up (one each took ~0.9 ms
    between two 16-row steps of a busy server)."""
    from nxdplug.engine import Engine, SamplingSettings
    from nxdplug.plugins.serve.engine_loop import EngineLoop

    engine = Engine(application)
    steps = []
    step = engine.step
    engine.step = lambda: steps.append(step()) or steps[-1]
    engine_loop = EngineLoop(engine)
    settings = SamplingSettings(max_tokens=12, temperature=0, ignore_eos=True)

    async def scenario() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        wakeups = []
        wake = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: wakeups.append(args) or wake(*args)
        streams = [await engine_loop.generate([1, 2, 3 + row], settings) for row in range(2)]
        stepper = _running(engine_loop)  # both queued first: they decode side by side
        tokens = [sum([len(o.token_ids) async for _, o in stream], 0) for stream in streams]
        handed = len(wakeups)
        engine_loop.stop()
        await asyncio.to_thread(stepper.join, 10)
        return tokens, handed

    tokens, wakeups = asyncio.run(scenario())
    assert tokens == [12, 12]
    with_outputs = sum(1 for outputs in steps if outputs)
    assert max(len(outputs) for outputs in steps) == 2  # some steps served both rows
    assert wakeups == with_outputs


@pytest.mark.filterwarnings("ignore:the model runs on thread:RuntimeWarning")  # the loop's thread
def test_work_between_steps_runs_on_the_stepping_thread(application) -> None:
    from nxdplug.engine import Engine, SamplingSettings
    from nxdplug.plugins.serve.engine_loop import EngineLoop

    engine = Engine(application)
    engine_loop = EngineLoop(engine)
    stepper = _running(engine_loop)
    settings = SamplingSettings(max_tokens=30, temperature=0, ignore_eos=True)

    def fails() -> None:
        raise ValueError("no such adapter")

    async def scenario() -> tuple[int, int, int]:
        idle = await engine_loop.between_steps(threading.get_ident)
        outputs = aiter(await engine_loop.generate([1, 2, 3], settings))
        _, first = await anext(outputs)  # a request runs: the work waits for a step's end
        busy = await engine_loop.between_steps(lambda: engine.num_running)
        with pytest.raises(ValueError, match="no such adapter"):
            await engine_loop.between_steps(fails)
        tokens = len(first.token_ids) + sum([len(o.token_ids) async for _, o in outputs], 0)
        return idle, busy, tokens

    idle, busy, tokens = asyncio.run(scenario())
    engine_loop.stop()
    stepper.join(timeout=10)
    assert idle == stepper.ident and busy == 1 and tokens == 30


SLOW_BUILD = 0.5  # seconds: what a large vocabulary's first constraint build may take


class SlowCompiler:
    """llguidance's compiler, built ``SLOW_BUILD`` late."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        from nxdplug.plugins.structured_outputs.guidance import GuidanceCompiler

        time.sleep(SLOW_BUILD)
        self.compiler = GuidanceCompiler(tokenizer, vocab_size)

    def compile(self, kind: str, spec: str):
        return self.compiler.compile(kind, spec)


class SlowBackend:
    @hookimpl
    def nxdplug_structured_output_backends(self):
        yield StructuredOutputBackend(
            name="slow-guidance", implementation=f"{__name__}:SlowCompiler", kinds=("regex",),
            priority=10,
        )  # fmt: skip


@pytest.mark.filterwarnings("ignore:the model runs on thread:RuntimeWarning")  # the loop's thread
def test_a_constraint_compiles_while_the_engine_steps(application, tokenizer) -> None:
    """A request's constraint is compiled on a worker thread: a running request keeps getting
    tokens meanwhile (the first compile held the engine and the event loop, 2.4 s for a 32k
    vocabulary)."""
    pytest.importorskip("llguidance")
    from nxdplug.engine import Engine, SamplingSettings
    from nxdplug.plugins.serve.engine_loop import EngineLoop

    engine = Engine(application, tokenizer)
    step = engine.step
    engine.step = lambda: time.sleep(0.02) or step()  # ~50 steps outlast the compile
    engine_loop = EngineLoop(engine)
    stepper = _running(engine_loop)
    plain = SamplingSettings(max_tokens=55, temperature=0, ignore_eos=True)
    held = SamplingSettings(max_tokens=8, temperature=0, structured_output=("regex", "[0-9]{3}"))

    async def scenario() -> tuple[float, float, list[float], str]:
        stream = aiter(await engine_loop.generate([1, 2, 3], plain))
        await anext(stream)
        arrivals: list[float] = []

        async def read() -> None:
            async for _ in stream:
                arrivals.append(time.monotonic())

        reading = asyncio.ensure_future(read())
        asked = time.monotonic()
        constrained = await engine_loop.generate([4, 5], held)
        compiled = time.monotonic()
        text = "".join([o.text async for _, o in constrained])
        await reading
        return asked, compiled, arrivals, text

    with temporary_plugin(SlowBackend(), "slow-guidance"):
        asked, compiled, arrivals, text = asyncio.run(scenario())
    engine_loop.stop()
    stepper.join(timeout=10)
    assert compiled - asked >= SLOW_BUILD and re.fullmatch("[0-9]{3}", text)
    assert sum(asked < t < compiled for t in arrivals) >= 5


def test_an_engine_failure_reaches_the_waiting_request(application) -> None:
    from nxdplug.engine import Engine, SamplingSettings
    from nxdplug.plugins.serve.engine_loop import EngineLoop

    class Broken:
        def run(self, step) -> None:
            raise RuntimeError("the device fell off")

    engine_loop = EngineLoop(Engine(application, runner=Broken()))
    stepper = _running(engine_loop)

    async def scenario() -> None:
        async for _ in await engine_loop.generate([1, 2], SamplingSettings(max_tokens=4)):
            pass

    with pytest.raises(RuntimeError, match="the device fell off"):
        asyncio.run(scenario())
    stepper.join(timeout=10)
    assert not stepper.is_alive() and not engine_loop.is_serving()
    assert str(engine_loop.failure) == "the device fell off"  # the server exits with it


# --- compiled by default ----------------------------------------------------------------------


def assert_greedy_completion(base: str, greedy, max_tokens: int) -> None:
    """A greedy completion from the server at ``base`` is HF's text for the prompt alone."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    prompt_ids = [5, 17, 300, 42, 9, 120]
    reply = client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.choices[0].text == greedy(prompt_ids, max_tokens)


SCORED = {"model": MODEL, "prompt": "a b", "echo": True, "logprobs": 1, "max_tokens": 1}


def test_without_a_folder_the_server_compiles_into_the_cache_once(
    checkpoint: Path, greedy, tmp_path: Path
) -> None:
    """No --compiled-model-path and no --enforce-eager: the graphs are compiled into the cache
    (NXDPLUG_CACHE_DIR here), without weights (read from the checkpoint at each start). A
    start killed (SIGKILL) half-way through compiling leaves no folder that looks complete;
    two servers then started at once on that cache both serve, one compiling while the other
    waits and reuses its folder, the only one the cache holds."""
    env = {"NXDPLUG_CACHE_DIR": str(tmp_path)}
    # lines, not blocks: the extension graphs prefix caching adds would double the compile
    options = ("--seq-len", "64", "--batch-size", "2", "--no-enable-prefix-caching")
    compiled = tmp_path / "compiled"
    killed = subprocess.Popen(
        [sys.executable, "-m", "nxdplug.cli.main", "serve", "--model-path", str(checkpoint),
         "--port", "0", "--torch-dtype", "float32", *options],
        env=os.environ | {"HF_HUB_OFFLINE": "1"} | env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(1200):  # until the first graph is written into the staged folder
            if any(compiled.glob(".*.partial/graphs/*")) or killed.poll() is not None:
                break
            time.sleep(0.05)
        assert killed.poll() is None, "the server ended before compiling"
    finally:
        killed.kill()
        killed.wait()
    assert [p.name for p in compiled.iterdir() if not p.name.startswith(".")] == []

    with ThreadPoolExecutor(2) as pool:
        starts = list(
            pool.map(lambda _: start_server(checkpoint, *options, env=env, eager=False), range(2))
        )
    stderrs = []
    try:
        for _, base in starts:
            assert_greedy_completion(base, greedy, 12)
        code, reply = post(starts[0][1], "completions", SCORED)
        # a server without --enable-prompt-logprobs says what to add
        assert code == 400 and reply["error"]["param"] == "prompt_logprobs", reply
        assert "--enable-prompt-logprobs" in reply["error"]["message"]
        for process, _ in starts:
            process.send_signal(signal.SIGTERM)
            stderrs.append(process.communicate(timeout=60)[1])
            assert process.returncode == 0, stderrs[-1]
    finally:
        for process, _ in starts:
            if process.poll() is None:
                process.kill()
    (folder,) = [p for p in compiled.iterdir() if not p.name.endswith(".lock")]
    assert (folder / "manifest.json").is_file() and not (folder / "weights").exists()
    assert sorted("already holds these graphs" in e for e in stderrs) == [False, True], stderrs


# --- tensor parallelism ------------------------------------------------------------------------


@contextlib.contextmanager
def two_rank_processes(
    checkpoint: Path, *options: str, env: dict[str, str] | None = None, eager: bool = True
) -> Iterator[tuple[subprocess.Popen, subprocess.Popen, str]]:
    """The two processes ``torchrun --nproc-per-node 2 nxdplug serve ...`` starts (one OpenMP
    thread each): the first rank, the follower, and the first rank's base URL; killed at the
    end if still running."""
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    launch |= {"OMP_NUM_THREADS": "1"} | (env or {})
    follower, _ = start_server(
        checkpoint, *options, env=launch | {"RANK": "1", "LOCAL_RANK": "1"}, eager=eager
    )
    try:
        first, base = start_server(
            checkpoint, *options, env=launch | {"RANK": "0", "LOCAL_RANK": "0"}, eager=eager
        )
        try:
            yield first, follower, base
        finally:
            if first.poll() is None:
                first.kill()
    finally:
        if follower.poll() is None:
            follower.kill()


@contextlib.contextmanager
def two_rank_servers(
    checkpoint: Path, *options: str, env: dict[str, str] | None = None, eager: bool = True
) -> Iterator[str]:
    """Two ranks serving (:func:`two_rank_processes`); the first rank's base URL. Both must
    exit 0 on Ctrl-C, as from a terminal."""
    with two_rank_processes(checkpoint, *options, env=env, eager=eager) as (first, follower, base):
        yield base
        stop([first, follower], signal.SIGINT)


def test_a_follower_rank_killed_mid_generation_stops_the_first(checkpoint: Path) -> None:
    """A tensor-parallel follower killed while a stream runs: the first rank answers that
    stream with an error and exits non-zero within seconds, never hangs."""
    options = ("--seq-len", "512", "--batch-size", "2", "--tp-degree", "2")
    with two_rank_processes(checkpoint, *options) as (first, follower, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
        stream = client.completions.create(
            model=MODEL, prompt="a b", max_tokens=500, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        next(chunks)
        follower.kill()
        killed = time.monotonic()
        with pytest.raises(openai.APIError):
            for _ in chunks:
                pass
        _, stderr = first.communicate(timeout=30)
        assert first.returncode == 1 and time.monotonic() - killed < 30
        assert "the engine failed, so the server stopped" in stderr, stderr


@pytest.mark.slow
def test_two_ranks_serve_hf_greedy_and_stop_together(
    checkpoint: Path, greedy, tmp_path: Path
) -> None:
    """As ``torchrun --nproc-per-node 2 nxdplug serve ... --tp-degree 2`` launches it, without a
    folder: the ranks compile their graphs into one folder of the cache and serve from it."""
    # lines, not blocks: the extension graphs prefix caching adds would double the compile
    options = ("--seq-len", "64", "--batch-size", "2", "--tp-degree", "2")
    options += ("--no-enable-prefix-caching",)
    cache = {"NXDPLUG_CACHE_DIR": str(tmp_path)}
    with two_rank_servers(checkpoint, *options, env=cache, eager=False) as base:
        assert_greedy_completion(base, greedy, 16)
    (folder,) = (tmp_path / "compiled").iterdir()
    manifest = json.loads((folder / "manifest.json").read_text())
    assert {graph["rank"] for graph in manifest["graphs"]} == {0, 1}
