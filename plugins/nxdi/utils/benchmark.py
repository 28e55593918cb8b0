"""NxD Inference's ``utils.benchmark``: ``benchmark_sampling`` and its report, under its names and
signatures, timed by nxdplug's own measurements."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

_BENCHMARK = "nxdplug.nxdi.demo.sampling_benchmark"

reexport(
    __name__,
    {
        "BENCHMARK_REPORT_PATH": f"{_BENCHMARK}:BENCHMARK_REPORT_PATH",
        "benchmark_sampling": f"{_BENCHMARK}:benchmark_sampling",
        "generate_report": f"{_BENCHMARK}:generate_report",
        "prepare_sampling_params": "nxdplug.runtime.sampling_params:prepare_sampling_params",
    },
)
