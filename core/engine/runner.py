"""What runs the serving engine's steps: the application, or a stand-in for every rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from nxdplug.contracts import optional

if TYPE_CHECKING:
    from nxdplug.runtime.outputs import CausalLMOutputWithTokens
    from nxdplug.runtime.scheduled_step import ScheduledStep


class StepRunner(Protocol):
    """The engine's ``runner``: the application itself, or, with tensor parallelism, one that
    hands each step to every rank (:class:`nxdplug.engine.ranks.StepBroadcaster`)."""

    def run(self, step: ScheduledStep) -> CausalLMOutputWithTokens:
        """Run one step of the model and return its outputs."""

    @optional
    def call_on_followers(self, function: str, args: tuple[Any, ...]) -> None:
        """Have every other rank run ``function`` (a ``"module:function"`` reference) with its
        application and ``args``, before the next step; a runner of one rank has none."""
