"""NxD Inference's ``models.qwen3_moe`` package."""
