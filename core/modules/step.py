"""One step's inputs to a phase's graph, as one typed record.

Every phase takes the core's four tensors; a feature adds per-row tensors of its own through a
``step_inputs`` plugin record (:class:`nxdplug.types.StepInput`), which the core carries by
name in ``extra`` without knowing what they mean. A compiled graph takes the same record
flattened to positional tensors (:meth:`StepInputs.flatten`), in an order fixed per sub-model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from nxdplug.errors import NxdPlugError

CORE_FIELDS = ("input_ids", "attention_mask", "position_ids", "seq_ids")


@attrs.frozen
class StepInputs:
    """The inputs of one step.

    - ``input_ids`` [batch, seq]: the tokens of this step;
    - ``attention_mask`` [batch, keys]: which cache positions 0..keys-1 hold valid tokens once
      this step's tokens are written (its width is the bucket: it fixes how much cache is read,
      and picks the compiled graph); a plugin's phase may give its own mask of the same width
      (a tree mask [batch, seq, keys]) and interpret it itself;
    - ``position_ids`` [batch, seq]: the cache position of each token;
    - ``seq_ids`` [batch]: the cache row of each batch entry;
    - ``extra``: the per-row tensors of the enabled step-input plugins, by name.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    seq_ids: torch.Tensor
    extra: Mapping[str, torch.Tensor] = attrs.field(factory=dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        """An extra input by name; a missing one says which inputs the step has."""
        try:
            return self.extra[name]
        except KeyError:
            have = ", ".join(self.extra) or "none"
            raise NxdPlugError(
                f"this step has no input {name!r} (its extra inputs: {have}); the plugin that "
                "declares it is not enabled for this sub-model"
            ) from None

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    def flatten(self, extra_names: Sequence[str]) -> tuple[torch.Tensor, ...]:
        """The core tensors, then the extra ones in ``extra_names`` order."""
        return (
            self.input_ids,
            self.attention_mask,
            self.position_ids,
            self.seq_ids,
            *(self[name] for name in extra_names),
        )

    @classmethod
    def unflatten(cls, extra_names: Sequence[str], tensors: Sequence[torch.Tensor]) -> StepInputs:
        """The inverse of :meth:`flatten`."""
        core, extra = tensors[: len(CORE_FIELDS)], tensors[len(CORE_FIELDS) :]
        return cls(*core, extra=dict(zip(extra_names, extra, strict=True)))

    def replace(self, **changes: Any) -> StepInputs:
        return attrs.evolve(self, **changes)

    def map_rows(self, function: Callable[[torch.Tensor], torch.Tensor]) -> StepInputs:
        """Every per-row tensor but ``seq_ids`` passed through ``function`` (padding rows,
        dropping them)."""
        return StepInputs(
            function(self.input_ids),
            function(self.attention_mask),
            function(self.position_ids),
            self.seq_ids,
            {name: function(tensor) for name, tensor in self.extra.items()},
        )


def _flatten(step: StepInputs) -> tuple[list[torch.Tensor], tuple[str, ...]]:
    names = tuple(step.extra)
    return list(step.flatten(names)), names


def _flatten_with_keys(step: StepInputs) -> tuple[list[tuple[Any, torch.Tensor]], tuple[str, ...]]:
    tensors, names = _flatten(step)
    keys = [*CORE_FIELDS, *names]
    return [(pytree.MappingKey(key), t) for key, t in zip(keys, tensors, strict=True)], names


def _unflatten(tensors: Any, names: tuple[str, ...]) -> StepInputs:
    return StepInputs.unflatten(names, list(tensors))


# A pytree node, so that torch.export traces a module taking a step as it is.
pytree.register_pytree_node(
    StepInputs,
    _flatten,
    _unflatten,
    # The name compiled folders store (from when this module was nxdplug.runtime.step).
    serialized_type_name="nxdplug.runtime.step.StepInputs",
    flatten_with_keys_fn=_flatten_with_keys,
)


_RUNNING: ContextVar[StepInputs | None] = ContextVar("nxdplug_step", default=None)


@contextmanager
def running(step: StepInputs) -> Iterator[StepInputs]:
    """Make ``step`` the one :func:`current_step` returns while the block runs the layers."""
    token = _RUNNING.set(step)
    try:
        yield step
    finally:
        _RUNNING.reset(token)


def current_step() -> StepInputs:
    """The step the model is running, for a module deep in it that needs a per-row input (a
    LoRA layer's adapter slots) without every layer passing the step along."""
    step = _RUNNING.get()
    if step is None:
        raise NxdPlugError("no step is running: current_step() is for modules inside a model")
    return step


@attrs.frozen
class Phase:
    """Which sub-model a step runs: its tag, and whether it encodes prompts (context
    encoding) or extends them (token generation, speculation)."""

    tag: str
    is_context_encoding: bool


_PHASE: ContextVar[Phase | None] = ContextVar("nxdplug_phase", default=None)


@contextmanager
def in_phase(phase: Phase) -> Iterator[Phase]:
    """Make ``phase`` the one :func:`current_phase` returns while the block runs (or traces)
    the model."""
    token = _PHASE.set(phase)
    try:
        yield phase
    finally:
        _PHASE.reset(token)


def encoding_prompts() -> bool:
    """Whether a context-encoding phase is being run or traced (False outside any phase)."""
    phase = _PHASE.get()
    return phase is not None and phase.is_context_encoding


def current_phase() -> Phase:
    """The phase being run or traced, for a module that differs between phases (weights laid
    out per phase, work done on prompts only). The choice is made on the host, so a compiled
    graph holds one phase's branch."""
    phase = _PHASE.get()
    if phase is None:
        raise NxdPlugError(
            "no phase is running: current_phase() is for modules inside a model that a "
            "sub-model (ModelWrapper) runs"
        )
    return phase
