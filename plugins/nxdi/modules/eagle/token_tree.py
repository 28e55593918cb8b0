"""NxD Inference's ``modules.eagle.token_tree``."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(__name__, {"TokenTree": "nxdplug.config.token_tree:TokenTree"})
