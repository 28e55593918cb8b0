"""NxD Inference's ``modules`` package."""
