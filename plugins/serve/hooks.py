"""``nxdplug serve`` and ``nxdplug benchmark-serving`` as a plugin, with the hooks it adds."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import NxdPlugPluginManager, Subcommand, hookimpl
from nxdplug.plugins.serve.hookspecs import RECORD_KINDS, ServingSpecs

NXDPLUG_API_VERSION = 2


@hookimpl
def nxdplug_add_hookspecs(pluginmanager: NxdPlugPluginManager) -> None:
    pluginmanager.add_plugin_hookspecs(ServingSpecs, *RECORD_KINDS)


@hookimpl
def nxdplug_commands() -> Iterable[Subcommand]:
    yield Subcommand(
        name="serve",
        description="serve a model over HTTP with OpenAI's completions and chat completions API",
        add_arguments="nxdplug.plugins.serve.cli:add_serve_arguments",
        run="nxdplug.plugins.serve.cli:run_serve",
    )
    yield Subcommand(
        name="benchmark-serving",
        description="load an OpenAI-compatible server with concurrent streamed requests (as "
        "vLLM's benchmark_serving.py); optionally against transformers serve",
        add_arguments="nxdplug.plugins.serve.benchmark.cli:add_benchmark_serving_arguments",
        run="nxdplug.plugins.serve.benchmark.cli:run_benchmark_serving",
    )
