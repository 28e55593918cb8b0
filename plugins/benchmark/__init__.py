"""``nxdplug benchmark``: timings of nxdplug and HF transformers in one run; its measurements
(latency statistics, timed generation, bytes per decode step, the roofline) serve the other
benchmarks too (``benchmark-serving``, NxD Inference's ``benchmark_sampling``)."""
