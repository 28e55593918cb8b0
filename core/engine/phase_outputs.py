"""Outputs that a plugin's own context-encoding phase computes for the requests that ask for
them (:class:`~nxdplug.types.PhaseOutput` records), as the engine serves them.

A request asks by the setting named after the record (``SamplingSettings(name=value)``). Its
prompt is then encoded whole (never after a cached prefix, which the phase would not see) by the
phase that name selects, in calls of such requests only; the request's row of the phase's
outputs becomes its output value, handed out on its first output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from nxdplug.engine.requests import Request, RequestError
from nxdplug.registry import Registry, get_registry

if TYPE_CHECKING:
    from nxdplug.engine.requests import SamplingSettings
    from nxdplug.runtime.application import NeuronBaseForCausalLM
    from nxdplug.runtime.outputs import CausalLMOutputWithTokens


class RowOutput(Protocol):
    """A PhaseOutput record's implementation, built with no arguments."""

    def problem(self, value: Any) -> str | None:
        """Why a request's value cannot be served (None: it can); the request is refused with
        ``"<name> <problem>"``."""

    def row_value(
        self,
        outputs: CausalLMOutputWithTokens,
        row: int,
        prompt_ids: Sequence[int],
        value: Any,
    ) -> Any:
        """The request's output, from its ``row`` of the phase's outputs and its value."""


class PhaseOutputs:
    """The installed phase outputs, and those the application's phases serve."""

    def __init__(
        self, application: NeuronBaseForCausalLM, registry: Registry | None = None
    ) -> None:
        registry = registry or get_registry()
        records = registry.records("phase_outputs")
        self.missing = {r.name: r.missing for r in records}
        self.rows: dict[str, RowOutput] = {r.name: r.load("implementation")() for r in records}
        self.served = application.selecting_keywords() & set(self.rows)
        self.disabled = [
            info.name for info in registry.manager.plugin_infos() if info.status == "disabled"
        ]

    def check(self, settings: SamplingSettings) -> None:
        """Refuse (RequestError, naming the setting) a plugin-added setting no enabled plugin
        adds, a value its plugin refuses, or two of them at once."""
        for name, value in settings.extras:
            if name not in self.rows:
                raise RequestError(self._unknown(name), field=name)
            problem = self.rows[name].problem(value)
            if problem is not None:
                raise RequestError(f"{name} {problem}", field=name)
        if len(settings.extras) > 1:
            names = ", ".join(name for name, _ in settings.extras)
            raise RequestError(f"{names}: a request may ask for one of them at a time")

    def check_served(self, settings: SamplingSettings) -> None:
        """Refuse a phase output the model has no phase for, saying how to get one."""
        for name, _ in settings.extras:
            if name not in self.served:
                raise RequestError(self.missing[name], field=name)

    def _unknown(self, name: str) -> str:
        message = f"{name}: no sampling setting has that name and no enabled plugin adds it"
        if self.disabled:
            message += (
                "; the plugin that adds it may be one of those NXDPLUG_ALLOW_PLUGINS / "
                f"NXDPLUG_DENY_PLUGINS disable: {', '.join(self.disabled)}"
            )
        return message

    def refuse_with_speculation(self, settings: SamplingSettings, method: str) -> None:
        """A fused speculator encodes prompts with its own phase, which computes none."""
        if settings.extras:
            name = settings.extras[0][0]
            raise RequestError(
                f"{name} are not given with {method!r} speculation: its own prompt phase "
                "encodes the prompt",
                field=name,
            )

    def selected(self, request: Request) -> str | None:
        """The phase output that the encoding of ``request``'s prompt computes: the one it
        asks for, unless its prompt was encoded before (it was preempted)."""
        if request.output_ids or not request.settings.extras:
            return None
        return request.settings.extras[0][0]

    def take(
        self, name: str, outputs: CausalLMOutputWithTokens, row: int, request: Request
    ) -> None:
        """Keep ``request``'s output from its ``row`` of the phase's ``outputs``."""
        value = request.settings.extra(name)
        request.phase_outputs[name] = self.rows[name].row_value(
            outputs, row, request.prompt_ids, value
        )
