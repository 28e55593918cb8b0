"""``nxdplug benchmark`` as a plugin: timings of nxdplug and HF transformers in one run."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import Subcommand, hookimpl

NXDPLUG_API_VERSION = 2


@hookimpl
def nxdplug_commands() -> Iterable[Subcommand]:
    yield Subcommand(
        name="benchmark",
        description="time context encoding and token generation (optionally against HF "
        "transformers)",
        add_arguments="nxdplug.plugins.benchmark.cli:add_benchmark_arguments",
        run="nxdplug.plugins.benchmark.cli:run_benchmark",
    )
