"""NxD Inference's ``inference_demo`` module: its ``main`` is ``nxdplug inference_demo``, so
``python -m nxdplug.nxdi.inference_demo --model-type llama --task-type causal-lm run ...`` runs
NxD Inference's command line on nxdplug."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(
    __name__,
    {
        "main": "nxdplug.nxdi.demo.command:main",
        "parse_args": "nxdplug.nxdi.demo.command:parse_args",
        "create_neuron_config": "nxdplug.nxdi.demo.command:create_neuron_config",
        # What NxD Inference's inference_demo imports from its other modules.
        "LogitMatchingValidationError": (
            "nxdplug.generation.logit_validation:LogitMatchingValidationError"
        ),
        "BENCHMARK_REPORT_PATH": "nxdplug.nxdi.demo.sampling_benchmark:BENCHMARK_REPORT_PATH",
        "load_pretrained_config": "nxdplug.config:load_pretrained_config",
        "benchmark_sampling": "nxdplug.nxdi.demo.sampling_benchmark:benchmark_sampling",
        "setup_run_parser": "nxdplug.nxdi.demo.flags:add_run_flags",
    },
)

if __name__ == "__main__":
    from nxdplug.nxdi.demo.command import console_main

    console_main()
