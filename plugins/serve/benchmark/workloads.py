"""The serving benchmark's workloads beside :mod:`nxdplug.plugins.serve.benchmark.load`'s random
one, each the case a serving feature is for.

- multi-turn (prefix caching): conversations run together, each a client sending its turns one
  after another; every conversation starts with the same system text, and turn k's prompt is
  the conversation so far (system + user 1 + reply 1 + ... + user k) as text, the replies being
  what the server streamed. A server that caches prefixes finds the earlier turns (and the
  system text) in its cache, which shows in the later turns' TTFT and in ``cached_tokens``.
- long-prompt (chunked prefill): streams decode together; once each has streamed
  ``long_after`` chunks with text (tokens, mostly), one request with a long prompt is sent. The
  streams' inter-token latency from then on shows how long the long prompt's encoding stalls
  them: the p99 / p50 ratio is near 1 when it is encoded in chunks beside them.

The requests are :func:`~nxdplug.plugins.serve.benchmark.load.timed_request`'s, timed the same way.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from nxdplug.plugin_api import NxdPlugError
from nxdplug.plugins.benchmark.measurements import LatencyStats
from nxdplug.plugins.serve.benchmark.load import RequestTimes, async_client, timed_request

# New tokens of the long-prompt workload's long request: its TTFT is what counts.
LONG_PROMPT_NEW_TOKENS = 4


def _milliseconds(name: str, samples: Sequence[float]) -> dict[str, float]:
    stats = LatencyStats.from_samples(samples)
    return {f"{name}_{q}_ms": getattr(stats, q) * 1e3 for q in ("p50", "p90", "p99")}


def _gaps(request: RequestTimes, since: float) -> list[float]:
    """The gaps between a request's consecutive chunks that end at ``since`` or later."""
    return [b - a for a, b in itertools.pairwise(request.chunks) if b >= since]


@attrs.frozen
class MultiTurnResult:
    """A multi-turn load: ``turns[k][c]`` is conversation c's turn k + 1."""

    turns: tuple[tuple[RequestTimes, ...], ...]
    duration_s: float

    def to_dict(self) -> dict[str, float]:
        """Flat numbers, latencies in milliseconds: the first turns' TTFT apart from the later
        turns' (those find the conversation so far in a prefix cache), and the prefix-cache hit
        rate when every response gave its ``cached_tokens``."""
        requests = [request for turn in self.turns for request in turn]
        prompt_tokens = sum(request.prompt_tokens for request in requests)
        output_tokens = sum(request.output_tokens for request in requests)
        numbers: dict[str, float] = {
            "conversations": len(self.turns[0]),
            "turns": len(self.turns),
            "requests": len(requests),
            "duration_s": self.duration_s,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / self.duration_s,
        }
        numbers |= _milliseconds("ttft_first_turn", [request.ttft for request in self.turns[0]])
        later = [request.ttft for turn in self.turns[1:] for request in turn]
        if later:
            numbers |= _milliseconds("ttft_later_turns", later)
        itls = [gap for request in requests for gap in request.itls]
        if itls:
            numbers |= _milliseconds("itl", itls)
        cached = [r.cached_tokens for r in requests if r.cached_tokens is not None]
        if len(cached) == len(requests):
            numbers["prefix_cache_hit_rate"] = sum(cached) / prompt_tokens
        return numbers


def run_multi_turn_load(
    base_url: str,
    model: str,
    system: str,
    users: Sequence[Sequence[str]],
    max_tokens: int,
    extra_body: dict[str, Any],
) -> MultiTurnResult:
    """Run ``len(users)`` conversations together, conversation c's turns taking ``users[c]``
    in order after the shared ``system`` text; ``max_tokens`` new tokens a turn. Any failed
    request fails the run."""
    return asyncio.run(_multi_turn(base_url, model, system, users, max_tokens, extra_body))


async def _multi_turn(
    base_url: str,
    model: str,
    system: str,
    users: Sequence[Sequence[str]],
    max_tokens: int,
    extra_body: dict[str, Any],
) -> MultiTurnResult:
    client = async_client(base_url)

    async def conversation(parts: Sequence[str]) -> list[RequestTimes]:
        text, times = system, []
        for turn, user in enumerate(parts, start=1):
            text += user
            try:
                request = await timed_request(client, model, text, max_tokens, extra_body)
            except NxdPlugError as exc:
                raise NxdPlugError(
                    f"turn {turn} of a conversation (its prompt: the system text and every "
                    f"turn so far, each adding a user part and a reply): {exc}"
                ) from exc
            times.append(request)
            text += request.text
        return times

    start = time.perf_counter()
    async with client:
        conversations = await asyncio.gather(*(conversation(parts) for parts in users))
    duration = time.perf_counter() - start
    return MultiTurnResult(turns=tuple(zip(*conversations, strict=True)), duration_s=duration)


@attrs.frozen
class LongPromptResult:
    """A long-prompt load: the streams, and the long request sent while they ran."""

    streams: tuple[RequestTimes, ...]
    long_request: RequestTimes
    duration_s: float

    def to_dict(self) -> dict[str, float]:
        """Flat numbers, latencies in milliseconds: the streams' ITL over their gaps from the
        long request's send to their end, and the long request's TTFT."""
        gaps = [gap for stream in self.streams for gap in _gaps(stream, self.long_request.start)]
        if not gaps:
            raise NxdPlugError(
                "the streams ended before the long prompt was sent, so nothing shows its "
                "effect; ask for more --max-tokens than --long-prompt-after"
            )
        itl = LatencyStats.from_samples(gaps)
        requests = (*self.streams, self.long_request)
        output_tokens = sum(request.output_tokens for request in requests)
        return {
            "streams": len(self.streams),
            "duration_s": self.duration_s,
            "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / self.duration_s,
            **_milliseconds("ttft", [stream.ttft for stream in self.streams]),
            "itl_p50_ms": itl.p50 * 1e3,
            "itl_p90_ms": itl.p90 * 1e3,
            "itl_p99_ms": itl.p99 * 1e3,
            "itl_p99_over_p50": itl.p99 / itl.p50,
            # the longest gap: a whole prompt encoded in one step stalls each stream once,
            # which a p99 over ~100 gaps a stream does not see
            "itl_max_ms": max(gaps) * 1e3,
            "long_prompt_tokens": self.long_request.prompt_tokens,
            "long_prompt_ttft_ms": self.long_request.ttft * 1e3,
        }


def run_long_prompt_load(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    long_prompt: str,
    long_after: int,
    extra_body: dict[str, Any],
) -> LongPromptResult:
    """Start a stream of ``max_tokens`` per prompt together; once each has streamed
    ``long_after`` chunks with text (or ended), send ``long_prompt`` for
    :data:`LONG_PROMPT_NEW_TOKENS` tokens. Any failed request fails the run."""
    return asyncio.run(
        _long_prompt(base_url, model, prompts, max_tokens, long_prompt, long_after, extra_body)
    )


async def _long_prompt(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    long_prompt: str,
    long_after: int,
    extra_body: dict[str, Any],
) -> LongPromptResult:
    client = async_client(base_url)
    under_way = asyncio.Event()
    behind = set(range(len(prompts)))  # the streams that have not streamed long_after chunks

    def caught_up(stream: int) -> None:
        behind.discard(stream)
        if not behind:
            under_way.set()

    def on_chunk(stream: int) -> Callable[[int], None]:
        return lambda chunks: caught_up(stream) if chunks >= long_after else None

    async def stream(index: int) -> RequestTimes:
        try:
            return await timed_request(
                client, model, prompts[index], max_tokens, extra_body, on_chunk(index)
            )
        finally:
            caught_up(index)  # a stream that ended holds the long request back no more

    async def long_request() -> RequestTimes:
        await under_way.wait()
        try:
            return await timed_request(
                client, model, long_prompt, LONG_PROMPT_NEW_TOKENS, extra_body
            )
        except NxdPlugError as exc:
            raise NxdPlugError(f"the long prompt (--long-prompt-length): {exc}") from exc

    start = time.perf_counter()
    async with client:
        *streams, long = await asyncio.gather(*map(stream, range(len(prompts))), long_request())
    duration = time.perf_counter() - start
    return LongPromptResult(streams=tuple(streams), long_request=long, duration_s=duration)
