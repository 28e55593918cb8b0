"""NxD Inference's ``modules.attention`` package."""
