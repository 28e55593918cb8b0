"""NxD Inference's ``models.mixtral`` package."""
