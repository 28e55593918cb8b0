"""NxD Inference's ``modules.eagle.dynamic_token_tree``."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(
    __name__, {"DynamicTokenTree": "nxdplug.plugins.eagle.dynamic_token_tree:DynamicTokenTree"}
)
