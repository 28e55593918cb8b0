"""NxD Inference's ``models.qwen3`` package."""
