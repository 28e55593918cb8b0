"""NxD Inference's ``utils.constants``: the test prompt, the benchmark report's path and
entries, and the phases' names. (``MODEL_TYPES`` is not provided: the registry lists the
model families, ``nxdplug plugins list``.)"""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

_BENCHMARK = "nxdplug.nxdi.demo.sampling_benchmark"
_WRAPPER = "nxdplug.runtime.model_wrapper"

reexport(
    __name__,
    {
        "TEST_PROMPT": "nxdplug.generation.accuracy:TEST_PROMPT",
        "BENCHMARK_REPORT_PATH": f"{_BENCHMARK}:BENCHMARK_REPORT_PATH",
        "END_TO_END_MODEL": f"{_BENCHMARK}:END_TO_END_MODEL",
        "CONTEXT_ENCODING_MODEL": f"{_WRAPPER}:CONTEXT_ENCODING_MODEL_TAG",
        "TOKEN_GENERATION_MODEL": f"{_WRAPPER}:TOKEN_GENERATION_MODEL_TAG",
        "SPECULATION_MODEL": f"{_WRAPPER}:SPECULATION_MODEL_TAG",
        "FUSED_SPECULATION_MODEL": f"{_WRAPPER}:FUSED_SPECULATION_MODEL_TAG",
    },
)
