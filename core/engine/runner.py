"""What runs the serving engine's steps: the application, or a stand-in for every rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from nxdplug.contracts import optional, with_defaults
from nxdplug.engine.speculative import move_kept_paths
from nxdplug.lazy import resolve_ref

if TYPE_CHECKING:
    from nxdplug.modules.step import StepInputs
    from nxdplug.runtime.application import NeuronBaseForCausalLM
    from nxdplug.runtime.outputs import CausalLMOutputWithTokens
    from nxdplug.runtime.scheduled_step import ScheduledStep

SUBMODEL_CALL = "nxdplug.engine.runner:run_submodel"
STEP_CALL = "nxdplug.engine.runner:run_step"
MOVE_CALL = "nxdplug.engine.runner:move_kept_paths_of"


class StepRunner(Protocol):
    """The engine's ``runner``: the application itself, or, with tensor parallelism, one that
    hands each step to every rank (:class:`nxdplug.engine.ranks.StepBroadcaster`)."""

    def run(self, step: ScheduledStep) -> CausalLMOutputWithTokens:
        """Run one step of the model and return its outputs."""

    @optional
    def call_on_followers(self, function: str, args: tuple[Any, ...]) -> None:
        """Have every other rank run ``function`` (a ``"module:function"`` reference) with its
        application and ``args``, before the next step; a runner of one rank has none."""

    @optional
    def call_on_every_rank(
        self, application: NeuronBaseForCausalLM, function: str, args: tuple[Any, ...]
    ) -> Any:
        """Run ``function`` (a ``"module:function"`` reference) with ``application`` and
        ``args`` here and, at once, on every other rank with its own; this rank's result. A
        runner of one rank runs it here."""
        return resolve_ref(function)(application, *args)


class EveryRank:
    """What a speculator runs on every rank at once: its sub-models' calls, or a draft's steps
    (their layers' collectives pair the ranks up), and changes to each rank's share of the
    cache. With tensor parallelism the engine's runner sends each call to the other ranks
    before running it here; the results, and the speculator's state per request, stay here."""

    def __init__(self, application: NeuronBaseForCausalLM, runner: StepRunner) -> None:
        self.application = application
        self.runner = with_defaults(runner, StepRunner)

    def of(self, application: NeuronBaseForCausalLM) -> EveryRank:
        """The same ranks running ``application``'s calls: a draft sharded as the target is,
        which every other rank holds too (a :class:`~nxdplug.engine.ranks.StepBroadcaster`
        names it to them)."""
        return EveryRank(application, self.runner)

    @classmethod
    def here(cls, application: NeuronBaseForCausalLM) -> EveryRank:
        """``application``'s calls run on this rank alone: a draft the first rank holds whole
        while the others serve the target with it."""
        return cls(application, application)

    def call(self, function: str, *args: Any) -> Any:
        """``function`` (a ``"module:function"`` reference) run on every rank with its
        application and ``args``; this rank's result."""
        return self.runner.call_on_every_rank(self.application, function, args)

    def submodel(self, tag: str, inputs: StepInputs) -> Any:
        """The sub-model ``tag`` run on ``inputs`` on every rank; this rank's outputs."""
        return self.call(SUBMODEL_CALL, tag, inputs)

    def run(self, step: ScheduledStep) -> CausalLMOutputWithTokens:
        """The application's ``step`` run on every rank; this rank's outputs."""
        return self.call(STEP_CALL, step)

    def move_kept_paths(
        self, lines: Sequence[int], roots: Sequence[int], paths: Sequence[Sequence[int]]
    ) -> None:
        """:func:`nxdplug.engine.speculative.move_kept_paths` in every rank's cache."""
        self.call(MOVE_CALL, list(lines), list(roots), [list(p) for p in paths])


# They run under inference mode on every rank alike (a follower runs a call outside it).
@torch.inference_mode()
def run_submodel(application: NeuronBaseForCausalLM, tag: str, inputs: StepInputs) -> Any:
    return application.submodel(tag)(inputs)


@torch.inference_mode()
def run_step(application: NeuronBaseForCausalLM, step: ScheduledStep) -> CausalLMOutputWithTokens:
    return application.run(step)


@torch.inference_mode()
def move_kept_paths_of(
    application: NeuronBaseForCausalLM,
    lines: Sequence[int],
    roots: Sequence[int],
    paths: Sequence[Sequence[int]],
) -> None:
    move_kept_paths(application.loaded_model.kv_mgr, lines, roots, paths)
