"""NxD Inference's ``utils.exceptions``."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

_VALIDATION = "nxdplug.generation.logit_validation"

reexport(__name__, {"LogitMatchingValidationError": f"{_VALIDATION}:LogitMatchingValidationError"})
