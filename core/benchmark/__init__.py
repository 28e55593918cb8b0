"""Measurements shared by the benchmark commands and NxD Inference's ``benchmark_sampling``:
latency statistics, timed generation, bytes per decode step and the roofline they imply."""
