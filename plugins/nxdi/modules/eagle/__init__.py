"""NxD Inference's ``modules.eagle`` package: its token tree."""
