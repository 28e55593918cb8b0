"""NxD Inference's ``utils`` package."""
