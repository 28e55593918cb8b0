"""NxD Inference's ``modules.moe_v2``: the MoE block of a decoder layer from its config."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(__name__, {"initialize_moe_module": "nxdplug.modules.moe:initialize_moe_module"})
