"""The Neuron backend: torch-neuronx traces each graph to a NEFF inside a TorchScript module.

Written against torch-neuronx's documented ``trace`` API; torch-neuronx cannot be installed on
the machines this project is developed on, so this backend is untested. Where torch-neuronx is
missing, choosing it fails at once with what to install.
"""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.hookspecs import hookimpl
from nxdplug.types import CompileBackend

NXDPLUG_API_VERSION = 1


@hookimpl
def nxdplug_compile_backends() -> Iterable[CompileBackend]:
    yield CompileBackend(
        name="neuron",
        implementation="nxdplug.plugins.neuron_backend.backend:NeuronBackend",
        priority=100,
        tp_degrees=(1, 2, 4, 8, 16, 24, 32, 64),
        capabilities={"nki-kernels"},
        description="torch-neuronx trace to NEFF (Trainium / Inferentia); untested here",
    )
