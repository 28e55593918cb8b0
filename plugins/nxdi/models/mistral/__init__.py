"""NxD Inference's ``models.mistral`` package."""
