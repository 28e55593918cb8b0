"""Serving a tensor-parallel model: the first rank schedules, every rank runs each step.

Under ``torchrun --nproc-per-node N`` each process holds one shard, and every forward call must
happen on all ranks with the same inputs (the layers' collectives pair them up). The first rank
runs the engine with a :class:`StepBroadcaster` as its runner: each call's inputs are broadcast
before it runs; the other ranks sit in :func:`follow_steps`, running what they receive. While the
engine is idle the broadcaster sends a heartbeat now and then, so that the followers' waiting
broadcast does not reach the process group's timeout. A change to what the model holds (an
adapter loaded at run time) is sent the same way, between two steps, as a function reference
each rank runs on its own application; so is a call every rank must make together that is no
scheduled step (a fused speculator's sub-model, :class:`nxdplug.engine.runner.EveryRank`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nxdplug.lazy import resolve_ref
from nxdplug.runtime.scheduled_step import ScheduledStep

if TYPE_CHECKING:
    from nxdplug.runtime.application import NeuronBaseForCausalLM

HEARTBEAT = "heartbeat"
STOP = "stop"
CALL = "call"
HEARTBEAT_SECONDS = 60.0


class StepBroadcaster:
    """The engine's runner on the first rank."""

    def __init__(
        self, application: NeuronBaseForCausalLM, heartbeat_seconds: float = HEARTBEAT_SECONDS
    ) -> None:
        self.application = application
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._beat, args=(heartbeat_seconds,), name="nxdplug-heartbeat", daemon=True
        )
        self._heartbeat.start()

    def run(self, step: ScheduledStep) -> Any:
        with self._lock:
            _send(step)
            return self.application.run(step)

    def call_on_followers(self, function: str, args: tuple[Any, ...]) -> None:
        """Have every other rank run ``function`` (a ``"module:function"`` reference) with its
        application and ``args``, before the next step."""
        with self._lock:
            _send((CALL, function, args))

    def call_on_every_rank(
        self, application: NeuronBaseForCausalLM, function: str, args: tuple[Any, ...]
    ) -> Any:
        """Run ``function`` with ``application`` and ``args`` here and on every other rank
        (a plugin's call of a sub-model); this rank's result."""
        with self._lock:
            _send((CALL, function, args))
            return resolve_ref(function)(application, *args)

    def stop(self) -> None:
        """Tell the followers to return; the broadcaster cannot be used after."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        # a follower may be gone (what made the engine fail): then nobody hears it
        with self._lock, contextlib.suppress(RuntimeError):
            _send(STOP)
        self._heartbeat.join()

    def _beat(self, seconds: float) -> None:
        while not self._stopped.wait(seconds):
            with self._lock:
                if not self._stopped.is_set():
                    _send(HEARTBEAT)


def follow_steps(application: NeuronBaseForCausalLM) -> None:
    """Run every step the first rank broadcasts, until it says stop."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
        if message == STOP:
            return
        if message == HEARTBEAT:
            continue
        if isinstance(message, tuple) and message[0] == CALL:
            _, function, args = message
            resolve_ref(function)(application, *args)
            continue
        with torch.inference_mode():
            application.run(message)


def _send(message: Any) -> None:
    dist.broadcast_object_list([message], src=0)
