"""NxD Inference's ``modules.eagle`` package: its token trees (static and dynamic) and EAGLE's
hidden-state rolling buffer."""
