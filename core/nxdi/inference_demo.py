"""NxD Inference's ``inference_demo`` module: its ``main`` is ``nxdplug inference_demo``, so
``python -m nxdplug.nxdi.inference_demo --model-type llama --task-type causal-lm run ...`` runs
NxD Inference's command line on nxdplug."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(
    __name__,
    {
        "main": "nxdplug.cli.inference_demo:main",
        "parse_args": "nxdplug.cli.inference_demo:parse_args",
        "create_neuron_config": "nxdplug.cli.inference_demo:create_neuron_config",
        # What NxD Inference's inference_demo imports from its other modules.
        "LogitMatchingValidationError": (
            "nxdplug.runtime.logit_validation:LogitMatchingValidationError"
        ),
        "BENCHMARK_REPORT_PATH": "nxdplug.benchmark.sampling_benchmark:BENCHMARK_REPORT_PATH",
        "load_pretrained_config": "nxdplug.config:load_pretrained_config",
        "benchmark_sampling": "nxdplug.benchmark.sampling_benchmark:benchmark_sampling",
        "setup_run_parser": "nxdplug.cli.inference_demo_flags:add_run_flags",
    },
)

if __name__ == "__main__":
    from nxdplug.cli.inference_demo import console_main

    console_main()
