"""NxD Inference's ``inference_demo`` as a command of ``nxdplug`` (and as its own script)."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import Subcommand, hookimpl

NXDPLUG_API_VERSION = 2


@hookimpl
def nxdplug_commands() -> Iterable[Subcommand]:
    yield Subcommand(
        name="inference_demo",
        description="NxD Inference's inference_demo command line: --model-type M --task-type "
        "causal-lm run --model-path P --compiled-model-path C --prompt TEXT [its flags]",
        add_arguments="nxdplug.nxdi.demo.command:add_inference_demo_arguments",
        run="nxdplug.nxdi.demo.command:run_inference_demo",
    )
