"""NxD Inference's inference_demo flags for the features plugins provide (see
:mod:`nxdplug.plugins.inference_demo_features.hooks`)."""
