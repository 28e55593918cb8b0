"""NxD Inference's ``inference_demo`` module: its ``main`` is ``nxdplug inference_demo``, so
``python -m nxdplug.nxdi.inference_demo --model-type llama --task-type causal-lm run ...`` runs
NxD Inference's command line on nxdplug."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(
    __name__,
    {
        "main": "nxdplug.cli.inference_demo:main",
        "setup_run_parser": "nxdplug.cli.inference_demo_flags:add_run_flags",
    },
)

if __name__ == "__main__":
    from nxdplug.cli.inference_demo import console_main

    console_main()
