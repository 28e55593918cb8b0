"""torch-neuronx tracing, behind an import guard.

The graph function takes ``(weights, caches, *inputs)``; torch-neuronx traces flat tuples of
tensors, so the lists are flattened, and the traced graph returns the updated caches after the
logits, which the loaded callable copies back into the caches it was given. (NxD Inference
keeps its cache on the device with input/output aliasing instead; that is the next step once
this can be run on a Neuron instance.) Untested: torch-neuronx does not install on the
machines this was written on.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

INSTALL_HINT = (
    "torch-neuronx is not installed; on a Trainium or Inferentia instance run "
    "`pip install torch-neuronx neuronx-cc --extra-index-url "
    "https://pip.repos.neuron.amazonaws.com`"
)


def _torch_neuronx() -> Any:
    return importlib.import_module("torch_neuronx")


class FlatGraph(nn.Module):
    """``forward(*weights, *caches, *inputs) -> (logits, *caches)`` over a graph function
    taking lists and updating the caches in place."""

    def __init__(self, function: nn.Module, num_weights: int, num_caches: int) -> None:
        super().__init__()
        self.function = function
        self.num_weights = num_weights
        self.num_caches = num_caches

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights = list(tensors[: self.num_weights])
        caches = list(tensors[self.num_weights : self.num_weights + self.num_caches])
        logits = self.function(weights, caches, *tensors[self.num_weights + self.num_caches :])
        return (logits, *caches)


class NeuronBackend:
    name = "neuron"
    produces_artefacts = True
    artefact_suffix = ".pt"

    def unavailable_reason(self) -> str | None:
        try:
            _torch_neuronx()
        except ImportError:
            return INSTALL_HINT
        return None

    def versions(self, config: InferenceConfig) -> dict[str, str]:
        found = {}
        for package in ("torch-neuronx", "neuronx-cc"):
            try:
                found[package] = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                found[package] = "missing"
        return found

    def compile_graph(
        self,
        function: nn.Module,
        example_args: tuple[Any, ...],
        output: Path,
        *,
        debug: bool,
        compiler_args: str | None,
    ) -> None:
        weights, caches, *inputs = example_args
        flat = FlatGraph(function, len(weights), len(caches))
        traced = _torch_neuronx().trace(
            flat,
            (*weights, *caches, *inputs),
            compiler_args=compiler_args,
            compiler_workdir=str(output.parent / f"{output.stem}.workdir") if debug else None,
        )
        torch.jit.save(traced, str(output))

    def embeds_weights(self, compiler_args: str | None) -> bool:
        return False

    def load_graph(self, path: Path, *, weights_in_graph: bool) -> Callable[..., torch.Tensor]:
        _torch_neuronx()  # registers the Neuron operators TorchScript needs to load the module
        module = torch.jit.load(str(path))

        def run(weights: list[torch.Tensor], caches: list[torch.Tensor], *inputs: Any) -> Any:
            logits, *updated = module(*weights, *caches, *inputs)
            for cache, new in zip(caches, updated, strict=True):
                cache.copy_(new)
            return logits

        return run
