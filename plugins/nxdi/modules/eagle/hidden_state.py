"""NxD Inference's ``modules.eagle.hidden_state``."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(
    __name__,
    {
        name: f"nxdplug.plugins.eagle.hidden_state:{name}"
        for name in ("HiddenStateRollingBuffer", "rolling_buffer_set_state")
    },
)
