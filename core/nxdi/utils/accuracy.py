"""NxD Inference's ``utils.accuracy``: the helpers nxdplug has under NxD Inference's names and
signatures. (``nxdplug.testing.check_accuracy`` takes other arguments than NxD Inference's
``check_accuracy``, so it is not offered under that name.)"""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(__name__, {"get_generate_outputs": "nxdplug.runtime.accuracy:get_generate_outputs"})
