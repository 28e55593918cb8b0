"""NxD Inference's ``models.dbrx`` package."""
