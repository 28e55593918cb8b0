"""NxD Inference's ``models.llama`` package."""
