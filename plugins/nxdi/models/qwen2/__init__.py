"""NxD Inference's ``models.qwen2`` package."""
