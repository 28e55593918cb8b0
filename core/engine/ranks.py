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
Such a call may be another application's that every rank holds a shard of (a draft model):
the first rank's broadcaster and the followers know it by the same name.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nxdplug.errors import NxdPlugError
from nxdplug.lazy import resolve_ref
from nxdplug.runtime.scheduled_step import ScheduledStep

if TYPE_CHECKING:
    from nxdplug.runtime.application import NeuronBaseForCausalLM

HEARTBEAT = "heartbeat"
STOP = "stop"
CALL = "call"
HEARTBEAT_SECONDS = 60.0


class StepBroadcaster:
    """The engine's runner on the first rank; ``others``: the other applications every rank
    holds a shard of (a draft), by the names :func:`follow_steps` is given them under."""

    def __init__(
        self,
        application: NeuronBaseForCausalLM,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
        others: Mapping[str, NeuronBaseForCausalLM] | None = None,
    ) -> None:
        self.application = application
        self.others = dict(others or {})
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
            _send((CALL, function, args, None))

    def call_on_every_rank(
        self, application: NeuronBaseForCausalLM, function: str, args: tuple[Any, ...]
    ) -> Any:
        """Run ``function`` with ``application`` and ``args`` here and, on every other rank,
        with its shard of ``application`` (the target or one of ``others``: a plugin's call
        of a sub-model, a draft's step); this rank's result."""
        name = self._name_of(application)
        with self._lock:
            _send((CALL, function, args, name))
            return resolve_ref(function)(application, *args)

    def _name_of(self, application: NeuronBaseForCausalLM) -> str | None:
        """None for the target; the name the followers know another application by."""
        if application is self.application:
            return None
        for name, other in self.others.items():
            if other is application:
                return name
        raise NxdPlugError(
            "a call on every rank of an application the other ranks do not hold: build it on "
            "every rank, and name it in StepBroadcaster's and follow_steps' others"
        )

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


def follow_steps(
    application: NeuronBaseForCausalLM, others: Mapping[str, NeuronBaseForCausalLM] | None = None
) -> None:
    """Run every step the first rank broadcasts, until it says stop; ``others``: this rank's
    shards of the other applications the first rank's broadcaster names (a draft)."""
    held = dict(others or {})
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
        if message == STOP:
            return
        if message == HEARTBEAT:
            continue
        if isinstance(message, tuple) and message[0] == CALL:
            _, function, args, name = message
            if name is not None and name not in held:
                raise NxdPlugError(
                    f"the first rank runs {function} on application {name!r}, which this "
                    f"rank does not hold (it holds: {', '.join(held) or 'none'}): give it "
                    "to follow_steps' others"
                )
            resolve_ref(function)(application if name is None else held[name], *args)
            continue
        with torch.inference_mode():
            application.run(message)


def _send(message: Any) -> None:
    dist.broadcast_object_list([message], src=0)
