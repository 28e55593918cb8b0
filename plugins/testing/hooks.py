"""The test kit as a plugin: ``nxdplug make-tiny-model`` is its command."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import Subcommand, hookimpl

NXDPLUG_API_VERSION = 2


@hookimpl
def nxdplug_commands() -> Iterable[Subcommand]:
    yield Subcommand(
        name="make-tiny-model",
        description="write a tiny random HF checkpoint of a registered architecture (offline)",
        add_arguments="nxdplug.testing.cli:add_make_tiny_model_arguments",
        run="nxdplug.testing.cli:run_make_tiny_model",
    )
