"""Load on an OpenAI-compatible server, as vLLM's ``benchmark_serving.py`` applies it.

``concurrency`` clients of the official ``openai`` package stream ``/v1/completions``
requests with greedy decoding (the stream's events read as JSON, see :func:`sse_events`),
each starting its next request when the last one ends, until ``num_requests`` have run.
Every request is stamped with ``perf_counter`` at its start, at each streamed chunk that
carries text, and at its end; its output tokens are the server's own count
(``stream_options.include_usage``). From those stamps:

- TTFT, time to first token: first chunk minus start;
- ITL, inter-token latency: the gaps between consecutive chunks (a chunk is usually one token;
  a server may hold back a token whose text is incomplete and send it with the next);
- TPOT, time per output token: (end - first chunk) / (output tokens - 1), per request, which
  does not depend on how tokens are grouped into chunks.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from nxdplug.plugin_api import NxdPlugError
from nxdplug.plugins.benchmark.measurements import LatencyStats

PROMPT_SEED = 0
REQUEST_TIMEOUT_S = 600.0
FIT_ROUNDS = 20


@attrs.frozen
class RequestTimes:
    """One streamed request: ``perf_counter`` at its start, at each chunk with text, and at its
    end; the text it streamed (a multi-turn conversation's next reply) and the prompt tokens the
    server found in its prefix cache (None from a server that does not say)."""

    start: float
    chunks: tuple[float, ...]
    end: float
    prompt_tokens: int
    output_tokens: int
    text: str
    cached_tokens: int | None

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.start

    @property
    def itls(self) -> list[float]:
        return [later - earlier for earlier, later in itertools.pairwise(self.chunks)]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.end - self.chunks[0]) / (self.output_tokens - 1)


@attrs.frozen
class ServingLoadResult:
    """The aggregates of one load run; latencies in seconds."""

    requests: int
    concurrency: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    chunks: int
    ttft: LatencyStats
    itl: LatencyStats
    tpot: LatencyStats
    e2e: LatencyStats

    @classmethod
    def from_requests(
        cls, times: Sequence[RequestTimes], concurrency: int, duration_s: float
    ) -> ServingLoadResult:
        itls = [gap for request in times for gap in request.itls]
        tpots = [t for t in (request.tpot for request in times) if t is not None]
        if not itls or not tpots:
            raise NxdPlugError(
                "no request streamed two chunks or more; ask for 2 --max-tokens or more"
            )
        return cls(
            requests=len(times),
            concurrency=concurrency,
            duration_s=duration_s,
            prompt_tokens=sum(request.prompt_tokens for request in times),
            output_tokens=sum(request.output_tokens for request in times),
            chunks=sum(len(request.chunks) for request in times),
            ttft=LatencyStats.from_samples([request.ttft for request in times]),
            itl=LatencyStats.from_samples(itls),
            tpot=LatencyStats.from_samples(tpots),
            e2e=LatencyStats.from_samples([request.end - request.start for request in times]),
        )

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.duration_s

    def to_dict(self) -> dict[str, float]:
        """Flat numbers, latencies in milliseconds."""
        numbers: dict[str, float] = {
            "requests": self.requests,
            "concurrency": self.concurrency,
            "duration_s": self.duration_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "chunks": self.chunks,
            "output_tokens_per_s": self.output_tokens_per_s,
            "requests_per_s": self.requests_per_s,
        }
        for name in ("ttft", "itl", "tpot", "e2e"):
            stats: LatencyStats = getattr(self, name)
            for q in ("p50", "p90", "p99"):
                numbers[f"{name}_{q}_ms"] = getattr(stats, q) * 1e3
        return numbers


def run_serving_load(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    concurrency: int,
    num_requests: int,
    extra_body: Mapping[str, Any] | None = None,
) -> ServingLoadResult:
    """Send ``num_requests`` streamed completions, at most ``concurrency`` at a time; request
    ``i`` takes ``prompts[i % len(prompts)]``. ``extra_body`` carries the server's own fields
    (``{"ignore_eos": True}`` for nxdplug). Any failed request fails the run."""
    times, duration = send_requests(
        base_url, model, prompts, max_tokens, concurrency, num_requests, extra_body
    )
    return ServingLoadResult.from_requests(times, concurrency, duration)


def send_requests(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    concurrency: int,
    num_requests: int,
    extra_body: Mapping[str, Any] | None = None,
) -> tuple[list[RequestTimes], float]:
    """:func:`run_serving_load`'s requests and their duration in seconds, without the
    statistics (that a warm-up has no use for, and that a request of one chunk cannot give)."""
    if not prompts:
        raise NxdPlugError("no prompts to send")
    return asyncio.run(
        _run_load(
            base_url, model, prompts, max_tokens, concurrency, num_requests, dict(extra_body or {})
        )
    )


async def _run_load(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    concurrency: int,
    num_requests: int,
    extra_body: dict[str, Any],
) -> tuple[list[RequestTimes], float]:
    client = async_client(base_url)
    queue = iter(range(num_requests))
    times: list[RequestTimes] = []

    async def client_loop() -> None:
        for index in queue:
            prompt = prompts[index % len(prompts)]
            times.append(await timed_request(client, model, prompt, max_tokens, extra_body))

    start = time.perf_counter()
    async with client:
        await asyncio.gather(*(client_loop() for _ in range(min(concurrency, num_requests))))
    return times, time.perf_counter() - start


def async_client(base_url: str) -> Any:
    """The clients' ``AsyncOpenAI``, over aiohttp, without retries (a failed request fails the
    run). Its connection pool allows 1000 connections: no queueing there."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(
        base_url=base_url,
        api_key="unused",
        timeout=REQUEST_TIMEOUT_S,
        max_retries=0,
        http_client=_aiohttp_client(),
    )


_INSTALL_CLIENTS = "pip install 'openai[aiohttp]>=1.89'"


def require_client_packages() -> None:
    """Refuse, saying what to install, when the clients' packages are missing: the ``openai``
    client with its aiohttp transport."""
    try:
        import aiohttp  # noqa: F401
        from openai import DefaultAioHttpClient  # noqa: F401
    except ImportError as exc:
        raise NxdPlugError(
            f"the benchmark's clients need {exc.name or 'openai'}, which is not installed (or "
            f"too old): {_INSTALL_CLIENTS}"
        ) from exc


def _aiohttp_client() -> Any:
    """The openai client's aiohttp transport (``openai[aiohttp]``), in place of its default
    httpx one: the clients read ~4000 chunks a second from nxdplug on the cores the server
    uses, and aiohttp's HTTP parser (C) takes 53-63 us of CPU a chunk against httpx's 101-109
    (2 cores, 2026-11-27), as vLLM's benchmark clients use aiohttp."""
    require_client_packages()
    from openai import DefaultAioHttpClient

    try:
        return DefaultAioHttpClient()
    except RuntimeError as exc:
        raise NxdPlugError(
            "the benchmark's clients use the openai client's aiohttp transport, which is not "
            f"installed: {_INSTALL_CLIENTS}"
        ) from exc


async def timed_request(
    client: Any,
    model: str,
    prompt: str,
    max_tokens: int,
    extra_body: dict[str, Any],
    on_chunk: Callable[[int], None] | None = None,
) -> RequestTimes:
    """One streamed completion, timed; ``on_chunk`` is told the number of chunks with text so
    far after each (the long-prompt workload waits for the streams to be under way)."""
    import openai

    chunks: list[float] = []
    text: list[str] = []
    usage = None
    start = time.perf_counter()
    try:
        async with client.completions.with_streaming_response.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra_body,
        ) as response:
            async for event in sse_events(response.iter_lines(), str(client.base_url)):
                choices = event.get("choices")
                if choices and choices[0].get("text"):
                    chunks.append(time.perf_counter())
                    text.append(choices[0]["text"])
                    if on_chunk is not None:
                        on_chunk(len(chunks))
                usage = event.get("usage") or usage
    except openai.OpenAIError as exc:
        raise NxdPlugError(f"a request to {client.base_url} failed: {exc}") from exc
    end = time.perf_counter()
    if usage is None:
        raise NxdPlugError(f"{client.base_url}: a streamed completion came without usage")
    if not chunks:
        raise NxdPlugError(
            f"{client.base_url}: a streamed completion of {usage['completion_tokens']} token(s) "
            "came without text, so nothing can be timed (a tokenizer with fewer tokens than the "
            "model's vocabulary decodes the others to nothing)"
        )
    return RequestTimes(
        start=start,
        chunks=tuple(chunks),
        end=end,
        prompt_tokens=usage["prompt_tokens"],
        output_tokens=usage["completion_tokens"],
        text="".join(text),
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
    )


async def sse_events(lines: AsyncIterator[str], server: str) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream's ``data`` events, up to ``[DONE]``.

    The clients parse the stream themselves, as vLLM's benchmark does, rather than through the
    ``openai`` package's chunk objects: those cost 165-205 us of CPU a chunk against 95-130
    here (2 cores, 2026-11-27, over the httpx transport), on the cores the server under test
    shares with its clients (see docs/serving-benchmark.md)."""
    data: list[str] = []
    async for line in lines:
        if line.startswith("data:"):
            data.append(line[6:] if line.startswith("data: ") else line[5:])
            continue
        if line or not data:
            continue  # another field, a comment, or a blank line between events
        payload = "\n".join(data)
        data.clear()
        if payload == "[DONE]":
            return
        try:
            event = json.loads(payload)
        except ValueError as exc:
            raise NxdPlugError(f"{server} streamed an event that is not JSON: {payload!r}") from exc
        if not isinstance(event, dict) or "error" in event:
            raise NxdPlugError(f"{server} streamed an error or an unexpected event: {payload!r}")
        yield event


def synthetic_prompts(
    tokenizer: Any, count: int, length: int, seed: int = PROMPT_SEED
) -> list[str]:
    """``count`` texts of seeded random tokens that the tokenizer encodes to ``length`` tokens.

    Ids are drawn from the tokenizer's ordinary tokens (no special ones). Decoded random ids do
    not always encode back to the same number (byte-level merges regroup them), so each text is
    re-encoded, cut or extended, and decoded again until its count is right, for a few rounds.
    """
    special = set(tokenizer.all_special_ids)
    pool = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(seed)
    return [_prompt_of_length(tokenizer, pool, length, rng) for _ in range(count)]


def _prompt_of_length(tokenizer: Any, pool: list[int], length: int, rng: random.Random) -> str:
    ids = rng.choices(pool, k=length)
    for _ in range(FIT_ROUNDS):
        text = tokenizer.decode(ids)
        encoded = tokenizer.encode(text)
        if len(encoded) == length:
            break
        ids = encoded[:length] + rng.choices(pool, k=max(0, length - len(encoded)))
    return text


def read_prompt_file(path: Path) -> list[str]:
    """Prompts from a file: JSON lines with a ``"prompt"`` (or ``"text"``, as in the project's
    prompts.jsonl) string each, or else one plain-text prompt per non-empty line."""
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise NxdPlugError(f"--prompt-file {path}: {exc}") from exc
    if not lines:
        raise NxdPlugError(f"--prompt-file {path} has no prompts")
    if not lines[0].lstrip().startswith("{"):
        return lines
    prompts = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
            prompts.append(next(record[k] for k in ("prompt", "text") if k in record))
        except (ValueError, TypeError, StopIteration) as exc:
            raise NxdPlugError(
                f"--prompt-file {path}, line {number}: expected a JSON object with a "
                f'"prompt" or "text" string ({type(exc).__name__})'
            ) from exc
    return prompts
