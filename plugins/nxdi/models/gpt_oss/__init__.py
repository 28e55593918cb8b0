"""NxD Inference's ``models.gpt_oss`` package."""
