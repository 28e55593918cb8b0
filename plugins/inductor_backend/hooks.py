"""The inductor backend: torch.export per sub-model and bucket, compiled ahead of time by
AOTInductor into packages a fresh process loads without recompiling."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import CompileBackend, NxdPlugPluginManager, hookimpl
from nxdplug.plugins.inductor_backend.hookspecs import RECORD_KINDS, InductorSpecs

NXDPLUG_API_VERSION = 2


@hookimpl
def nxdplug_add_hookspecs(pluginmanager: NxdPlugPluginManager) -> None:
    pluginmanager.add_plugin_hookspecs(InductorSpecs, *RECORD_KINDS)


@hookimpl
def nxdplug_compile_backends() -> Iterable[CompileBackend]:
    yield CompileBackend(
        name="inductor",
        implementation="nxdplug.plugins.inductor_backend.backend:InductorBackend",
        priority=50,
        description="torch.export + AOTInductor packages (.pt2), CPU",
    )
