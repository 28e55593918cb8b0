"""The eager backend: sub-models run as plain PyTorch modules, what ``to_cpu()`` uses."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import CompileBackend, hookimpl

NXDPLUG_API_VERSION = 2


@hookimpl
def nxdplug_compile_backends() -> Iterable[CompileBackend]:
    yield CompileBackend(
        name="eager",
        implementation="nxdplug.plugins.eager_backend.backend:EagerBackend",
        priority=0,
        description="plain PyTorch on the host (CPU, or CUDA tensors); no artefact",
    )
