"""A soak of ``nxdplug serve``: 2,000 requests from 32 clients, with random prompts, lengths and
sampling settings, a third of them streamed and cancelled at a random point, some with bad
fields. No request is lost (each gets its answer or its error), no KV-cache block or line is
left in use, and the server's memory after the soak is within 10% of what it was after the
first 100 requests."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

aiohttp = pytest.importorskip("aiohttp")

from tests.plugins.serve.test_serving import (  # noqa: E402
    MODEL,
    checkpoint,  # noqa: F401 (a fixture)
    metric,
    start_server,
    stop,
    wait_until_idle,
)

REQUESTS = 2000
CLIENTS = 32
WARM_UP = 100
BAD = [
    {"temperature": -1},
    {"max_tokens": 10_000},
    {"made_up": 1},
    {"logit_bias": {"x": 1}},
    {"top_p": 0},
]


def resident_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def job(rng: random.Random) -> tuple[dict, str]:
    """A request body and what is expected of it: ok, bad (a 400) or cancel (closed early)."""
    body = {
        "model": MODEL,
        "prompt": [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))],
        "max_tokens": rng.randint(1, 24),
        "temperature": rng.choice([0, 0.7, 1.0]),
        "top_p": rng.choice([1.0, 0.9]),
        "seed": rng.randrange(1000),
        "ignore_eos": True,
    }
    kind = rng.choices(["ok", "cancel", "bad"], weights=[62, 33, 5])[0]
    if kind == "bad":
        body |= rng.choice(BAD)
    body["stream"] = kind == "cancel" or rng.random() < 0.3
    return body, kind


async def soak(base: str, jobs: list[tuple[dict, str]], on_warm) -> list[str]:
    """Run the jobs from CLIENTS clients; what each ended as."""
    results: list[str] = [""] * len(jobs)
    queue = list(enumerate(jobs))
    done = 0

    async def client(session: aiohttp.ClientSession, rng: random.Random) -> None:
        nonlocal done
        while queue:
            index, (body, kind) = queue.pop(0)
            async with session.post(f"{base}/v1/completions", json=body) as reply:
                if kind == "cancel":
                    chunks = rng.randint(0, 3)
                    async for _ in reply.content:
                        chunks -= 1
                        if chunks < 0:
                            break
                    reply.close()  # the client hangs up
                    results[index] = f"cancelled {reply.status}"
                elif reply.status != 200:
                    error = (await reply.json())["error"]
                    results[index] = f"error {reply.status} {error['param']}"
                else:
                    text = await reply.text()
                    events = [e for e in text.split("\n\n") if e] if body["stream"] else [text]
                    last = "[DONE]" if body["stream"] else json.loads(text)["usage"]
                    assert events[-1].endswith("[DONE]") if body["stream"] else last
                    results[index] = "ok 200"
            done += 1
            if done == WARM_UP:
                on_warm()

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session, random.Random(i)) for i in range(CLIENTS)))
    return results


def test_a_soak_loses_no_request_and_leaks_nothing(checkpoint) -> None:  # noqa: F811
    rng = random.Random(0)
    jobs = [job(rng) for _ in range(REQUESTS)]
    process, base = start_server(checkpoint, "--seq-len", "128", "--batch-size", "8")
    try:
        warm: list[int] = []
        results = asyncio.run(soak(base, jobs, lambda: warm.append(resident_kib(process.pid))))
        wait_until_idle(base)
        after = resident_kib(process.pid)
        for (_, kind), result in zip(jobs, results, strict=True):
            expected = {"ok": "ok 200", "bad": "error 400", "cancel": "cancelled 200"}[kind]
            assert result.startswith(expected), (kind, result)
        assert metric(base, "nxdplug:kv_cache_usage_perc") == 0
        assert metric(base, "nxdplug:kv_cache_lines_in_use") == 0
        assert after <= 1.1 * warm[0], (warm[0], after)
        stop([process])
    finally:
        if process.poll() is None:
            process.kill()
