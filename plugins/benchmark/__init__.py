"""``nxdplug benchmark``: timings of nxdplug and HF transformers in one run."""
