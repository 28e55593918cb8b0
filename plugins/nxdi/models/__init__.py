"""NxD Inference's ``models`` package: the configs and one package per model family."""
