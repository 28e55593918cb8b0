"""The contract between the compile pipeline and compile-backend plugins, and backend choice.

A backend plugin's ``implementation`` is a class built with no arguments. Its instances turn one
sub-model bucket, given as a pure function of ``(weights, caches, *inputs)``, into an artefact
file, and load such a file back as a callable with the same signature. Weights and KV caches are
graph inputs, so every graph of a model shares one copy of each, and weights can be swapped
without recompiling. A backend whose graphs take some weights in a layout of their own (the
inductor backend's prepacked linear weights) converts them once, for all its graphs, in an
optional ``form_graph_weights`` method. ``CompileBackend.implementation`` is checked against
:class:`Backend` when the record is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from nxdplug.contracts import optional, with_defaults
from nxdplug.errors import NotSupportedError
from nxdplug.pipeline import requested_backend
from nxdplug.registry import get_registry
from nxdplug.types import CompileBackend

if TYPE_CHECKING:
    from nxdplug.config import InferenceConfig, NeuronConfig


class Backend(Protocol):
    name: str
    produces_artefacts: bool
    artefact_suffix: str

    def unavailable_reason(self) -> str | None:
        """None when the backend can run here; otherwise what is missing and how to get it."""

    def versions(self, config: InferenceConfig) -> dict[str, str]:
        """Versions (and target device) that shape the artefacts of ``config``'s graphs (an
        InferenceConfig), for the manifest hash."""

    def compile_graph(
        self,
        function: nn.Module,
        example_args: tuple[Any, ...],
        output: Path,
        *,
        debug: bool,
        compiler_args: str | None,
    ) -> None:
        """Write the artefact of ``function`` traced at ``example_args`` to ``output``."""

    def embeds_weights(self, compiler_args: str | None) -> bool:
        """Whether these compiler arguments fold the weights into each graph (then the example
        weights given to compile_graph are the real ones, and the graphs ignore the weights
        passed to them)."""

    def load_graph(self, path: Path, *, weights_in_graph: bool) -> Callable[..., torch.Tensor]:
        """The compiled callable stored at ``path``, taking ``(weights, caches, *inputs)``."""

    @optional
    def form_graph_weights(self, weights: list[torch.Tensor]) -> set[int]:
        """Put the stored weights, in place, in the form the backend's loaded graphs take
        them, and return the indices it replaced (by default none: the weights as stored). A
        replaced weight is the graphs' own form (prepacked, stacked with others), which
        in-place writes into the stored weight cannot reach."""
        return set()


def weights_former(backend: Backend) -> Callable[[list[torch.Tensor]], set[int]]:
    """The backend's :meth:`Backend.form_graph_weights`, or its default."""
    return with_defaults(backend, Backend).form_graph_weights


def instantiate(record: CompileBackend) -> Backend:
    return record.load("implementation")()


def choose_backend(neuron_config: NeuronConfig) -> tuple[CompileBackend, Backend]:
    """The backend ``compile()`` uses.

    A requested backend is used or refused, never replaced by another; otherwise the available
    artefact-producing backend with the highest priority wins.
    """
    registry = get_registry()
    name = requested_backend(neuron_config)
    if name is not None:
        record = registry.get("compile_backends", name)
        backend = instantiate(record)
        if not backend.produces_artefacts:
            raise NotSupportedError(
                f"the {name!r} backend runs models eagerly and writes no compiled artefacts; "
                "use to_cpu(), or choose another backend for compile()"
            )
        reason = backend.unavailable_reason()
        if reason is not None:
            raise NotSupportedError(f"the {name!r} compile backend is not available: {reason}")
        return record, backend
    refused = []
    for record in sorted(registry.records("compile_backends"), key=lambda r: -r.priority):
        backend = instantiate(record)
        if not backend.produces_artefacts:
            continue
        reason = backend.unavailable_reason()
        if reason is None:
            return record, backend
        refused.append(f"{record.name}: {reason}")
    raise NotSupportedError(
        "no compile backend that writes artefacts is available"
        + (f" ({'; '.join(refused)})" if refused else "")
        + "; install one, or run the model with to_cpu()"
    )
