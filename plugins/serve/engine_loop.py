"""The engine's step loop, with an asyncio face for request handlers.

The engine is stepped from one thread only, the one that loaded the model (``nxdplug serve``'s
main thread: a model called from a second thread runs its steps up to 2x slower, see
:mod:`nxdplug.runtime.step_ahead`); HTTP handlers run on the event loop's thread. The loop
sleeps while the engine has nothing to do, steps while it has, and hands a step's outputs to
their requests' :class:`OutputStream` in one ``loop.call_soon_threadsafe``. A stream that is closed
before its request ended (a client gone, a cancelled handler) aborts the request, so its
KV-cache line is freed at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from nxdplug.plugin_api import NxdPlugError, RequestError, RequestOutput, SamplingSettings

if TYPE_CHECKING:
    from nxdplug.plugin_api import Engine, Request
    from nxdplug.plugins.serve.metrics import ServingMetrics

logger = logging.getLogger("nxdplug.plugins.serve")
# How long the idle loop sleeps at most between looks at its work. The loop runs on the main
# thread, where Python runs signal handlers, but only between bytecodes: Ctrl-C or SIGTERM that
# the kernel hands to another thread (an HTTP or OpenMP thread) leaves an untimed wait asleep,
# and the server would not stop until a request came.
IDLE_WAKE_SECONDS = 0.25


class EngineStoppedError(NxdPlugError):
    """The engine loop stopped (shutting down, or after an engine failure): a 503."""


Item = RequestOutput | BaseException
# How work run between steps reports back: its result, or the exception it raised.
Report = Callable[[Any, BaseException | None], None]


@attrs.define
class _Consumer:
    """Where one request's outputs go (``deliver``, called on ``loop``'s thread, or on the
    engine's without a loop), and its clock for the latency metrics."""

    deliver: Callable[[Item], None]
    arrival: float
    loop: asyncio.AbstractEventLoop | None = None
    last_token: float | None = None


class OutputStream:
    """The outputs of one prompt's requests (OpenAI's ``n`` choices, one by default) for
    ``async for``, as ``(choice index, output)`` pairs: each request's in order, the requests'
    interleaved as they come; a request's last output has ``finished`` set.

    Leaving the loop early (``break``, an exception, a cancelled task) aborts every request
    that has not ended.
    """

    def __init__(
        self, request_ids: Sequence[str], queue: asyncio.Queue, abort: Callable[[str], None]
    ):
        self.request_ids = list(request_ids)
        self._queue = queue
        self._abort = abort
        self._unfinished = set(range(len(self.request_ids)))

    @property
    def request_id(self) -> str:
        """The first request's id, which names the whole answer."""
        return self.request_ids[0]

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            while self._unfinished:
                index, item = await self._queue.get()
                if isinstance(item, BaseException):
                    self._unfinished.clear()
                    raise item
                if item.finished:
                    self._unfinished.discard(index)
                yield index, item
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Abort the requests that have not ended (idempotent)."""
        for index in sorted(self._unfinished):
            self._abort(self.request_ids[index])
        self._unfinished.clear()


class EngineLoop:
    """Steps ``engine`` on the thread that calls :meth:`run` while requests are unfinished;
    the other methods may be called from any thread.

    ``metrics`` (optional) records each output's tokens and latencies.
    """

    def __init__(self, engine: Engine, metrics: ServingMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._wake = threading.Condition()
        self._consumers: dict[str, _Consumer] = {}
        self._between_steps: list[tuple[Callable[[], Any], Report]] = []
        self._accepting = True
        self._stopping = False
        # what made the engine fail, once it has (the server then stops, exiting non-zero)
        self.failure: Exception | None = None

    def is_serving(self) -> bool:
        """True until the loop is stopped or the engine failed."""
        return self._accepting

    async def generate(
        self,
        prompt_ids: Sequence[int],
        settings: SamplingSettings,
        n: int = 1,
        step_keywords: Mapping[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> OutputStream:
        """Queue ``n`` requests for the prompt and return their outputs' stream; call from the
        event loop. See :meth:`generate_batch`."""
        return await self.generate_batch([prompt_ids], settings, n, step_keywords, cache_salt)

    async def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        settings: SamplingSettings,
        n: int = 1,
        step_keywords: Mapping[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> OutputStream:
        """Queue ``n`` requests for each prompt (choices, each its own sample; with a seed,
        choice i of a prompt is seeded ``seed + i``, as vLLM does) and return their outputs'
        stream, whose choice index is ``prompt index * n + i``; call from the event loop.
        ``step_keywords`` and ``cache_salt`` go with every request (``Engine.add_request``).

        Raises what ``engine.add_request`` raises (RequestError, EngineFullError), or
        EngineStoppedError when the loop no longer takes requests; the requests queued before
        the one refused are aborted. More requests than the engine's queue holds at all are a
        RequestError. Requests with a structured output are prepared (their constraints
        compiled) on a worker thread, so that neither the event loop nor the engine waits for
        a compile.
        """
        total = len(prompts) * n
        if total > self.engine.max_waiting:
            raise RequestError(
                f"{len(prompts)} prompt(s) x n={n} make {total} requests, more than the "
                f"server's queue holds ({self.engine.max_waiting}, --max-waiting)",
                field="n",
            )
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        request_ids = [f"req-{uuid.uuid4().hex}" for _ in range(total)]

        def prepare() -> list[Request]:
            prepared = []
            for index, request_id in enumerate(request_ids):
                choice = settings
                if settings.seed is not None and index % n:
                    choice = attrs.evolve(settings, seed=settings.seed + index % n)
                prompt = prompts[index // n]
                prepared.append(
                    self.engine.prepare(prompt, choice, request_id, step_keywords, cache_salt)
                )
            return prepared

        if settings.structured_output is None:
            requests = prepare()
        else:
            requests = await asyncio.to_thread(prepare)
        for index, request in enumerate(requests):
            try:
                self.submit(request, _tagged(queue, index), loop)
            except BaseException:
                for queued in request_ids[:index]:
                    self.abort(queued)
                raise
        return OutputStream(request_ids, queue, self.abort)

    def submit(
        self,
        request: Request,
        deliver: Callable[[Item], None],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """Queue a prepared request (``Engine.prepare``) whose outputs (or the engine's
        failure) go to ``deliver``, which is called on ``loop``'s thread, or without a loop on
        the thread that steps the engine; thread-safe."""
        with self._wake:
            if not self._accepting:
                raise EngineStoppedError("the server is shutting down; no new requests")
            self._consumers[request.request_id] = _Consumer(deliver, time.monotonic(), loop)
            try:
                self.engine.enqueue(request)
            except BaseException:
                del self._consumers[request.request_id]
                raise
            self._wake.notify()

    async def between_steps(self, work: Callable[[], Any]) -> Any:
        """Run ``work`` on the thread that steps the engine, between two steps (at once when
        it is idle), and return what it returns or raise what it raises; call from the event
        loop. For work that changes what the model holds while requests run."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(result: Any, failure: BaseException | None) -> None:
            if done.cancelled():
                return
            if failure is None:
                done.set_result(result)
            else:
                done.set_exception(failure)

        def report(result: Any, failure: BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop closed: nobody waits
                loop.call_soon_threadsafe(settle, result, failure)

        with self._wake:
            if not self._accepting:
                raise EngineStoppedError("the server is shutting down")
            self._between_steps.append((work, report))
            self._wake.notify()
        return await done

    def abort(self, request_id: str) -> None:
        """Cancel a request; thread-safe. Its last output (finish_reason "abort") still comes."""
        self.engine.abort(request_id)
        with self._wake:
            self._wake.notify()

    def stop(self) -> None:
        """Stop taking requests and abort the running ones; :meth:`run` delivers their last
        outputs and returns."""
        with self._wake:
            self._accepting = False
            self._stopping = True
            for request_id in self._consumers:
                self.engine.abort(request_id)
            self._wake.notify()

    def run(self) -> None:
        """Step the engine until :meth:`stop` was called and no request is left, or until the
        engine fails (``failure``: every request is answered with the error, new ones with
        503); closes the engine."""
        try:
            while self._wait_for_work():
                self._run_between_steps()
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    self._deliver(outputs, time.monotonic())
        except Exception as exc:
            logger.exception("the engine failed; the server stops taking requests")
            self.failure = exc
            with self._wake:
                self._accepting = False
                consumers, self._consumers = list(self._consumers.values()), {}
                calls, self._between_steps = self._between_steps, []
            _hand_over([(consumer, exc) for consumer in consumers])
            for _, report in calls:
                report(None, EngineStoppedError(f"the engine failed: {exc}"))
        finally:
            self.engine.close()

    def _wait_for_work(self) -> bool:
        """Sleep until the engine or :meth:`between_steps` has work; False once stopping and
        nothing is left."""
        with self._wake:
            while not (self.engine.has_unfinished() or self._between_steps):
                if self._stopping:
                    return False
                self._wake.wait(IDLE_WAKE_SECONDS)
            return True

    def _run_between_steps(self) -> None:
        with self._wake:
            calls, self._between_steps = self._between_steps, []
        for work, report in calls:
            try:
                result, failure = work(), None
            except Exception as exc:
                result, failure = None, exc
            report(result, failure)

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        handed: list[tuple[_Consumer, Item]] = []
        with self._wake:
            for output in outputs:
                consumer = self._consumers.get(output.request_id)
                if output.finished:
                    self._consumers.pop(output.request_id, None)
                if consumer is not None:
                    handed.append((consumer, output))
        for consumer, output in handed:
            if self.metrics is not None:
                self.metrics.record(output, consumer.arrival, consumer.last_token, now)
            if output.token_ids:
                consumer.last_token = now
        _hand_over(handed)


def _tagged(queue: asyncio.Queue, index: int) -> Callable[[Item], None]:
    """Puts a choice's items into its prompt's queue, with the choice's index."""

    def deliver(item: Item) -> None:
        queue.put_nowait((index, item))

    return deliver


def _hand_over(items: list[tuple[_Consumer, Item]]) -> None:
    """Give each item to its consumer, with one wake-up of each event loop for all of its
    consumers' items: a wake-up is a write to the loop's self-pipe and a switch to its thread,
    and one per output took ~0.9 ms between two 16-row steps of ``nxdplug serve``."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Callable[[Item], None], Item]]]
    by_loop = defaultdict(list)
    for consumer, item in items:
        if consumer.loop is None:
            consumer.deliver(item)
        else:
            by_loop[consumer.loop].append((consumer.deliver, item))
    for loop, deliveries in by_loop.items():
        # A closed event loop raises RuntimeError: nobody waits for these requests any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_deliver_each, deliveries)


def _deliver_each(deliveries: list[tuple[Callable[[Item], None], Item]]) -> None:
    for deliver, item in deliveries:
        deliver(item)
