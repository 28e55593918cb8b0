"""Multi-LoRA in the serving engine and in ``nxdplug serve``: a request names its adapter (the
server: as its model, as vLLM does), requests with different adapters decode side by side, and
each gets the tokens PEFT gives its prompt alone with that adapter."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from nxdplug import (
    HuggingFaceGenerationAdapter,
    LoraServingConfig,
    NeuronConfig,
    from_pretrained,
)
from nxdplug.engine import Engine, RequestError, SamplingSettings
from tests.plugins.lora.test_lora_dynamic import peft_with_adapters, three_adapters

PROMPTS = [[5, 9, 13, 2, 8], [7, 3, 11], [4, 4, 20, 6], [9, 1, 30]]
ROWS = ["code", "chat", None, "math"]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    return three_adapters(tiny_checkpoint, tmp_path_factory)


@pytest.fixture(scope="module")
def peft_solo(adapters):
    """PEFT's greedy tokens for one prompt alone with one adapter (None: the base model)."""
    model = peft_with_adapters(*adapters)

    def generate(prompt: list[int], adapter: str | None) -> list[int]:
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor([prompt]),
                adapter_names=[adapter or "__base__"],
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[0, len(prompt) :].tolist()

    return generate


def engine_for(
    checkpoint, paths, max_loras: int, scored: bool = False, cache: dict | None = None, **lora
) -> Engine:
    lora_config = LoraServingConfig(
        max_loras=max_loras, max_lora_rank=8, lora_ckpt_paths=paths, **lora
    )
    config = NeuronConfig(
        torch_dtype="float32",
        is_continuous_batching=True,
        batch_size=4,
        seq_len=32,
        lora_config=lora_config,
        enable_prompt_logprobs=scored,
        **(cache or {}),
    )
    app = from_pretrained(checkpoint, config)
    app.to_cpu()
    return Engine(app, eos_token_ids=[])


def serve(engine: Engine, rows) -> tuple[list[list[int]], int]:
    """Every prompt with its adapter, queued at once; each one's tokens, and the most distinct
    adapters that ever ran together."""
    ids = [
        engine.add_request(prompt, SamplingSettings(NEW_TOKENS, 0), step_keywords=keywords)
        for prompt, keywords in zip(PROMPTS, rows, strict=True)
    ]
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    most = 0
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.token_ids
        running = {r.step_keywords.get("adapter_ids") for r in engine._running.values()}
        most = max(most, len(running - {None}))
    return [tokens[request_id] for request_id in ids], most


def test_requests_with_different_adapters_get_peft_tokens(adapters, peft_solo) -> None:
    checkpoint, paths = adapters
    engine = engine_for(checkpoint, paths, max_loras=3)
    rows = [{"adapter_ids": a} if a else {} for a in ROWS]
    tokens, most = serve(engine, rows)
    assert tokens == [peft_solo(p, a) for p, a in zip(PROMPTS, ROWS, strict=True)]
    assert most == 3  # the three adapters decoded side by side
    assert len({tuple(t) for t in tokens}) == len(tokens)
    base = peft_solo(PROMPTS[0], None)
    assert tokens[0] != base  # the adapter changed the output


def test_adapters_never_share_cached_blocks(adapters, peft_solo) -> None:
    """With prefix caching, the same prompt under another adapter (or none) finds nothing
    cached, and each gets PEFT's tokens; under the same adapter it finds its blocks."""
    checkpoint, paths = adapters
    cache = {"is_block_kv_layout": True, "pa_block_size": 4, "is_prefix_caching": True}
    engine = engine_for(checkpoint, paths, max_loras=3, cache=cache)
    prompt = [5, 9, 13, 2, 8, 7, 3, 11, 4, 4]
    for adapter, cached in [("code", 0), ("chat", 0), (None, 0), ("code", 8), (None, 8)]:
        keywords = {"adapter_ids": adapter} if adapter else {}
        engine.add_request(prompt, SamplingSettings(NEW_TOKENS, 0), step_keywords=keywords)
        tokens = []
        while engine.has_unfinished():
            for output in engine.step():
                tokens += output.token_ids
        assert (tokens, output.cached_tokens) == (peft_solo(prompt, adapter), cached)


def test_prompt_logprobs_are_those_of_the_requests_adapter(adapters) -> None:
    """The scoring phase takes the adapter rows as the core's context encoding does: each
    prompt scored with its own adapter, as PEFT's log-softmax of it."""
    checkpoint, paths = adapters
    engine = engine_for(checkpoint, paths, max_loras=3, scored=True)
    ids = [
        engine.add_request(
            prompt, SamplingSettings(2, 0, prompt_logprobs=0), step_keywords=keywords
        )
        for prompt, keywords in zip(
            PROMPTS, [{"adapter_ids": a} if a else {} for a in ROWS], strict=True
        )
    ]
    scores = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.prompt_logprobs is not None:
                scores[output.request_id] = [s.logprob for s in output.prompt_logprobs[1:]]
    model = peft_with_adapters(checkpoint, paths)
    with torch.no_grad():
        for request_id, prompt, adapter in zip(ids, PROMPTS, ROWS, strict=True):
            logits = model(
                input_ids=torch.tensor([prompt]), adapter_names=[adapter or "__base__"]
            ).logits
            expected = logits[0, :-1].log_softmax(-1).gather(-1, torch.tensor(prompt[1:])[:, None])
            assert scores[request_id] == pytest.approx(expected[:, 0].tolist(), abs=1e-4)


def test_a_request_waits_while_its_adapter_has_no_slot(adapters, peft_solo) -> None:
    """Two slots, three adapters (dynamic): the third adapter's request waits until a running
    adapter's requests end, then takes its slot."""
    checkpoint, paths = adapters
    engine = engine_for(
        checkpoint, paths, max_loras=2, enable_dynamic_multi_lora=True, max_cpu_loras=3
    )
    tokens, most = serve(engine, [{"adapter_ids": a} for a in ("code", "chat", "math", "code")])
    expected = [
        peft_solo(p, a) for p, a in zip(PROMPTS, ("code", "chat", "math", "code"), strict=True)
    ]
    assert tokens == expected and most == 2
    assert engine.lines.in_use == 0 and not engine.has_unfinished()


def test_a_request_whose_adapter_fits_goes_ahead_of_one_that_waits(adapters) -> None:
    """As vLLM's scheduler: the math request waits for a slot, the code request queued after
    it runs beside the running code and chat ones at once; math stays first in line."""
    checkpoint, paths = adapters
    engine = engine_for(
        checkpoint, paths, max_loras=2, enable_dynamic_multi_lora=True, max_cpu_loras=3
    )
    adapters_in_order = ("code", "chat", "math", "code")
    for prompt, adapter in zip(PROMPTS, adapters_in_order, strict=True):
        engine.add_request(prompt, SamplingSettings(3, 0), step_keywords={"adapter_ids": adapter})
    engine.step()
    running = sorted(r.step_keywords["adapter_ids"] for r in engine.unfinished_requests()[1:])
    assert running == ["chat", "code", "code"] and engine.num_waiting == 1
    assert engine.unfinished_requests()[0].step_keywords["adapter_ids"] == "math"
    while engine.has_unfinished():
        engine.step()
    assert engine.lines.in_use == 0


def test_a_waiting_adapter_is_passed_over_at_most_once_per_line(adapters) -> None:
    """A code and a chat request arrive every step (running 2 to 5 steps, so that lines free
    one at a time) while math waits for a slot that those two adapters hold: once as many
    requests went ahead of it as the engine has lines (4), no more do, a slot drains and math
    runs. Without the bound, 15 went ahead of it on this load."""
    checkpoint, paths = adapters
    engine = engine_for(
        checkpoint, paths, max_loras=2, enable_dynamic_multi_lora=True, max_cpu_loras=3
    )
    for prompt, adapter in zip(PROMPTS[:3], ("code", "chat", "math"), strict=True):
        engine.add_request(prompt, SamplingSettings(3, 0), step_keywords={"adapter_ids": adapter})
    (math,) = [r for r in engine.unfinished_requests() if r.step_keywords["adapter_ids"] == "math"]
    for step in range(30):
        for offset, adapter in enumerate(("code", "chat")):
            settings = SamplingSettings(2 + (step + 2 * offset) % 4, 0)  # lines free in turns
            engine.add_request(PROMPTS[3], settings, step_keywords={"adapter_ids": adapter})
        engine.step()
    assert math.finished and math.times_passed_over == engine.max_batch_size == 4
    while engine.has_unfinished():
        engine.step()
    assert engine.lines.in_use == 0


def test_generate_with_more_rows_than_lines_gives_each_row_its_adapter(adapters) -> None:
    """generate(adapter_ids=[...]) on 5 rows over 4 lines runs them through the engine, each
    row's request with its adapter: PEFT's mixed batch gives the same tokens."""
    checkpoint, paths = adapters
    engine = engine_for(checkpoint, paths, max_loras=3)
    rows = [*ROWS, "chat"]
    prompts = [*PROMPTS, [2, 6, 8, 10, 12]]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    common = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "eos_token_id": None}
    ours = HuggingFaceGenerationAdapter(engine.application).generate(
        ids, attention_mask=mask, adapter_ids=rows, pad_token_id=0, **common
    )
    with torch.no_grad():
        expected = peft_with_adapters(checkpoint, paths).generate(
            input_ids=ids,
            attention_mask=mask,
            adapter_names=[row or "__base__" for row in rows],
            pad_token_id=0,
            **common,
        )
    assert torch.equal(ours, expected)


def test_an_adapter_unloaded_while_a_request_is_prepared_refuses_it(adapters) -> None:
    """A request is prepared (a constraint compiled) outside the engine's lock; if its adapter
    is unloaded meanwhile, queuing it is refused, not its step."""
    checkpoint, paths = adapters
    engine = engine_for(
        checkpoint, paths, max_loras=2, enable_dynamic_multi_lora=True, max_cpu_loras=3
    )
    request = engine.prepare(
        PROMPTS[0], SamplingSettings(3, 0), step_keywords={"adapter_ids": "math"}
    )
    engine.apply_to_model("nxdplug.plugins.lora.store:unload_adapter", "math")
    with pytest.raises(RequestError, match="not among the served adapters") as caught:
        engine.enqueue(request)
    assert caught.value.field == "adapter_ids" and not engine.has_unfinished()


def test_unknown_adapters_and_keywords_are_refused(adapters) -> None:
    checkpoint, paths = adapters
    engine = engine_for(checkpoint, paths, max_loras=3)
    with pytest.raises(RequestError, match="not among the served adapters") as caught:
        engine.add_request([1, 2], step_keywords={"adapter_ids": "poetry"})
    assert caught.value.field == "adapter_ids"
    with pytest.raises(RequestError, match="no enabled plugin takes it") as caught:
        engine.add_request([1, 2], step_keywords={"banned_tokens": [3]})
    assert caught.value.field == "banned_tokens"
    assert not engine.has_unfinished()
    assert set(engine.inputs.served_names()) == {"code", "chat", "math"}


def test_serve_names_each_adapter_as_a_model(adapters, peft_solo) -> None:
    """``nxdplug serve --lora-modules``: /v1/models lists the adapters beside the base model
    (their parent); a request naming one gets PEFT's tokens with it, streamed or not."""
    openai = pytest.importorskip("openai")
    from tests.plugins.serve.test_serving import MODEL, post, start_server, stop

    checkpoint, paths = adapters
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    modules = [f"{name}={path}" for name, path in paths.items()]
    process, base = start_server(
        checkpoint, "--seq-len", "32", "--batch-size", "4", "--lora-modules", *modules
    )
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {MODEL, "code", "chat", "math"}
        assert cards["chat"].parent == MODEL and getattr(cards[MODEL], "parent", None) is None
        common = {"max_tokens": NEW_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
        for prompt, adapter in zip(PROMPTS, ROWS, strict=True):
            expected = tokenizer.decode(peft_solo(prompt, adapter), skip_special_tokens=True)
            reply = client.completions.create(model=adapter or MODEL, prompt=prompt, **common)
            assert reply.choices[0].text == expected, adapter
        chunks = client.completions.create(model="math", prompt=PROMPTS[3], stream=True, **common)
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert streamed == tokenizer.decode(peft_solo(PROMPTS[3], "math"), skip_special_tokens=True)
        with pytest.raises(openai.NotFoundError, match="`code`, `chat`, `math`"):
            client.completions.create(model="poetry", prompt=[1, 2], max_tokens=2)
        status, _ = post(base, "unload_lora_adapter", {"lora_name": "code"})
        assert status == 404  # the adapter routes exist only with the server's opt-in
    finally:
        stop([process])


def test_serve_loads_and_unloads_adapters_at_run_time(adapters, peft_solo) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter with dynamic multi-LoRA and
    the server's opt-in: a loaded adapter is a model at once; one that a request uses is not
    unloaded under it; a path outside the allowed folder is refused, however it gets there
    (``..``, a link)."""
    openai = pytest.importorskip("openai")
    from tests.plugins.serve.test_serving import MODEL, post, start_server, stop

    checkpoint, paths = adapters
    allowed = Path(paths["math"]).parent
    outside = allowed.parent / "elsewhere"
    shutil.copytree(paths["chat"], outside / "chat", dirs_exist_ok=True)
    link = allowed / "link-out"
    link.unlink(missing_ok=True)
    link.symlink_to(outside / "chat")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    process, base = start_server(
        checkpoint, "--seq-len", "64", "--batch-size", "4", "--enable-dynamic-multi-lora",
        "--lora-modules", f"code={paths['code']}", "--max-loras", "2", "--max-cpu-loras", "2",
        "--allow-runtime-lora-updating", "--allowed-lora-paths", str(allowed),
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        common = {"max_tokens": NEW_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
        assert [m.id for m in client.models.list().data] == [MODEL, "code"]
        for path in (f"{allowed}/../elsewhere/chat", str(link), str(outside / "chat")):
            status, error = post(base, "load_lora_adapter", {"lora_name": "c", "lora_path": path})
            assert status == 400, path
            assert "not in a folder this server reads adapters from" in error["error"]["message"]
        body = {"lora_name": "math", "lora_path": paths["math"]}
        assert post(base, "load_lora_adapter", body) == (
            200,
            {"object": "lora_adapter", "id": "math", "status": "loaded"},
        )
        assert [m.id for m in client.models.list().data] == [MODEL, "code", "math"]
        reply = client.completions.create(model="math", prompt=PROMPTS[3], **common)
        expected = peft_solo(PROMPTS[3], "math")
        assert reply.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
        status, error = post(base, "load_lora_adapter", body)
        assert status == 400 and "loaded already" in error["error"]["message"]
        status, error = post(base, "load_lora_adapter", {"lora_name": "x"})
        assert status == 400 and "lora_path" in error["error"]["message"]

        stream = client.completions.create(
            model="code", prompt=PROMPTS[0], stream=True, max_tokens=50, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        next(iter(stream))  # the request runs
        status, error = post(base, "unload_lora_adapter", {"lora_name": "code"})
        assert status == 400 and "used by 1 waiting or running" in error["error"]["message"]
        stream.close()
        for _ in range(100):
            status, reply = post(base, "unload_lora_adapter", {"lora_name": "code"})
            if status == 200:
                break
            time.sleep(0.05)  # the closed stream's request ends at the next step
        assert reply == {"object": "lora_adapter", "id": "code", "status": "unloaded"}
        assert [m.id for m in client.models.list().data] == [MODEL, "math"]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="code", prompt=[1, 2], max_tokens=2)
    finally:
        stop([process])


@pytest.mark.slow
def test_two_ranks_load_and_unload_adapters_on_every_rank(adapters, peft_solo) -> None:
    """``torchrun --nproc-per-node 2 nxdplug serve --tp-degree 2`` with dynamic multi-LoRA: an
    adapter loaded through the first rank's route is loaded into every rank's shard, so a
    request naming it runs on both; unloading forgets it on both."""
    openai = pytest.importorskip("openai")
    from tests.plugins.serve.test_serving import post, two_rank_servers

    checkpoint, paths = adapters
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    options = (
        "--seq-len", "64", "--batch-size", "2", "--tp-degree", "2",
        "--enable-dynamic-multi-lora", "--max-loras", "2", "--max-cpu-loras", "2",
        "--max-lora-rank", "8", "--allow-runtime-lora-updating",
        "--allowed-lora-paths", str(Path(paths["math"]).parent),
    )  # fmt: skip
    with two_rank_servers(checkpoint, *options) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        common = {"max_tokens": NEW_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
        for name in ("math", "chat"):
            body = {"lora_name": name, "lora_path": paths[name]}
            assert post(base, "load_lora_adapter", body)[0] == 200
        for prompt, name in ((PROMPTS[3], "math"), (PROMPTS[1], "chat")):
            reply = client.completions.create(model=name, prompt=prompt, **common)
            expected = tokenizer.decode(peft_solo(prompt, name), skip_special_tokens=True)
            assert reply.choices[0].text == expected
        assert post(base, "unload_lora_adapter", {"lora_name": "math"})[0] == 200
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="math", prompt=[1, 2], max_tokens=2)
        reply = client.completions.create(model="chat", prompt=PROMPTS[1], **common)
        assert reply.choices[0].text == expected


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--allow-runtime-lora-updating"], "set enable_dynamic_multi_lora"),
        (
            ["--allow-runtime-lora-updating", "--enable-dynamic-multi-lora"],
            "allow_runtime_lora_updating needs allowed_lora_paths",
        ),
        (["--allowed-lora-paths", "."], "only allow_runtime_lora_updating"),
    ],
)
def test_adapter_routes_need_the_opt_in_and_its_folders(adapters, capsys, options, message):
    from nxdplug.cli.main import main

    checkpoint, paths = adapters
    argv = ["serve", "--model-path", str(checkpoint), "--port", "0", "--enforce-eager"]
    code = main([*argv, "--lora-modules", f"code={paths['code']}", *options])
    error = capsys.readouterr().err
    assert code == 1 and message in error and "Traceback" not in error
