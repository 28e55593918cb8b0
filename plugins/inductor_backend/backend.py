"""AOTInductor: export a graph function, compile it to a ``.pt2`` package, load it back."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from nxdplug.plugin_api import ConfigError, NxdPlugError
from nxdplug.plugins.inductor_backend.bf16_linear import may_hold_bf16_weights, panels_in_use
from nxdplug.plugins.inductor_backend.fused_linears import declared_stackable_ops
from nxdplug.plugins.inductor_backend.graph_runner import load_package
from nxdplug.plugins.inductor_backend.prepacked_linear import (
    PrepackedWeights,
    prepacking_available,
    use_prepacked_linears,
)

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

C_COMPILERS = ("c++", "g++", "clang++")

# Inductor prints every max_autotune timing table to stderr; keep them unless asked for.
QUIET_AUTOTUNE = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
# nxdplug's own compiler argument (not an inductor option): prepack_weights=false keeps plain
# linear weights (see prepacked_linear).
PREPACK_ARGUMENT = "prepack_weights"
# How PyTorch says a loaded graph calls an operator nobody registered (a plugin's custom op).
UNREGISTERED_OPERATOR = re.compile(r"Could not find schema for (\S+?)\.?$", re.MULTILINE)


def parse_compiler_args(compiler_args: str | None) -> dict[str, Any]:
    """``"max_autotune=true cpp.threads=2"`` -> inductor config options (JSON values)."""
    options: dict[str, Any] = {}
    for item in (compiler_args or "").split():
        key, separator, raw = item.partition("=")
        if not separator or not key:
            raise ConfigError(
                [f"inductor compiler argument {item!r} is not KEY=VALUE (e.g. max_autotune=true)"]
            )
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
    return options


@contextmanager
def torch_internal_warnings_silenced() -> Iterator[None]:
    """torch 2.13's export/AOTI emit deprecation warnings about their own internals."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=r".*requires gradient.*", category=UserWarning)
        warnings.filterwarnings(
            "ignore", message=r"TypedStorage is deprecated", category=UserWarning
        )
        yield


class WeightsAsConstants(nn.Module):
    """A graph function with its weights held as module state, so that inductor's freezing can
    fold and prepack them: ``forward(caches, *inputs)``."""

    def __init__(self, function: nn.Module, weights: list[torch.Tensor]) -> None:
        super().__init__()
        object.__setattr__(self, "function", function)
        self.weights = nn.ParameterList(nn.Parameter(w, requires_grad=False) for w in weights)

    def forward(self, caches: list[torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        return self.function(list(self.weights), caches, *inputs)


class InductorBackend:
    """AOTInductor packages. The weights are graph inputs shared by every graph, linear weights
    prepacked once for oneDNN, bf16 ones in panels for nxdplug's kernel where the CPU has
    AVX512-BF16 (``prepack_weights=false`` keeps them plain). With the compiler
    argument ``freezing=true`` the weights are folded into each graph instead: one copy of the
    weights per graph and no weight swapping without recompiling."""

    name = "inductor"
    produces_artefacts = True
    artefact_suffix = ".pt2"

    def __init__(self) -> None:
        self.prepacked = PrepackedWeights()

    def embeds_weights(self, compiler_args: str | None) -> bool:
        return bool(parse_compiler_args(compiler_args).get("freezing"))

    def unavailable_reason(self) -> str | None:
        if not hasattr(torch._inductor, "aoti_compile_and_package"):
            return f"torch {torch.__version__} has no AOTInductor packaging; use torch >= 2.6"
        if not any(shutil.which(c) for c in C_COMPILERS):
            return "AOTInductor needs a C++ compiler on PATH (install g++)"
        return None

    def versions(self, config: InferenceConfig) -> dict[str, str]:
        # The application builds weights, caches and inputs on the CPU, so the graphs are CPU
        # graphs; CUDA needs those tensors placed on the GPU first (not done yet). Panels are
        # named only where a weight may be bf16: a float32 folder compiled on a CPU with
        # AVX512-BF16 loads on one without.
        linear_weights = "onednn-linear-3"
        if panels_in_use() and may_hold_bf16_weights(config):
            linear_weights = "bf16-panels-1, " + linear_weights
        return {"torch": torch.__version__, "device": "cpu", "linear_weights": linear_weights}

    def compile_graph(
        self,
        function: nn.Module,
        example_args: tuple[Any, ...],
        output: Path,
        *,
        debug: bool,
        compiler_args: str | None,
    ) -> None:
        options = QUIET_AUTOTUNE | parse_compiler_args(compiler_args)
        prepack = options.pop(PREPACK_ARGUMENT, True)
        frozen = self.embeds_weights(compiler_args)
        weights, *rest = example_args
        if frozen:
            function, example_args = WeightsAsConstants(function, weights), tuple(rest)
        with torch_internal_warnings_silenced():
            program = torch.export.export(function, example_args, strict=False)
            if prepack and not frozen and prepacking_available():
                options["aot_inductor.metadata"] = use_prepacked_linears(
                    program, len(weights), declared_stackable_ops()
                )
            if debug:
                output.with_suffix(".graph.txt").write_text(annotated_graph(program))
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(output), inductor_configs=options
            )

    def load_graph(self, path: Path, *, weights_in_graph: bool) -> Callable[..., torch.Tensor]:
        panels_in_use()  # registers the panel kernel that bf16 graphs compiled here call
        try:
            with torch_internal_warnings_silenced():
                loader = load_package(path)
        except RuntimeError as error:
            unregistered = UNREGISTERED_OPERATOR.search(str(error))
            if unregistered is None:
                raise
            raise NxdPlugError(
                f"{path} calls the operator {unregistered.group(1)}, which is not registered in "
                "this process: the plugin that provides it did not register it (a warning above "
                "may say why, e.g. its extension could not be built here). Load the folder where "
                "the plugin's operator is available, or compile the model again here."
            ) from None
        if not weights_in_graph:
            self.prepacked.add_graph(dict(loader.get_metadata()), str(path))
        return FlatCallGraph(loader, takes_weights=not weights_in_graph)

    def form_graph_weights(self, weights: list[torch.Tensor]) -> set[int]:
        """The weights in the form the graphs loaded so far take them, in place: linear
        weights no graph reads otherwise prepacked, those multiplied together stacked."""
        return self.prepacked.form_all(weights)


class FlatCallGraph:
    """A loaded package (see :mod:`.graph_runner`) called as ``graph(weights, caches, *inputs)``
    with the tensors passed flat. ``AOTICompiledModel.__call__`` parses the argument and output
    structures from JSON and flattens every argument on each call, about 0.1 ms of a decode step
    with a model's hundred-odd weights (measured on the Mixtral-shaped model of docs/moe.md);
    here the output structure is read once."""

    def __init__(self, loader: Any, *, takes_weights: bool) -> None:
        self.loader = loader
        self.takes_weights = takes_weights
        self.out_spec = pytree.treespec_loads(self.loader.get_call_spec()[1])

    def __call__(
        self, weights: list[torch.Tensor], caches: list[torch.Tensor], *inputs: Any
    ) -> Any:
        flat = [*weights, *caches] if self.takes_weights else list(caches)
        flat.extend(t for t in inputs if isinstance(t, torch.Tensor))
        return pytree.tree_unflatten(self.loader.boxed_run(flat), self.out_spec)


def annotated_graph(program: torch.export.ExportedProgram) -> str:
    """The exported graph, each node followed by the source line that produced it."""
    lines = [str(program.graph_signature), ""]
    for node in program.graph.nodes:
        lines.append(node.format_node())
        trace = node.meta.get("stack_trace")
        if trace:
            source = trace.strip().splitlines()[-2:]
            lines.extend(f"    # {line.strip()}" for line in source)
    return "\n".join(lines) + "\n"
