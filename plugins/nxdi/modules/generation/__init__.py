"""NxD Inference's ``modules.generation`` package."""
