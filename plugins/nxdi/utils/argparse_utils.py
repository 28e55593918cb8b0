"""NxD Inference's ``utils.argparse_utils``."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

_FLAGS = "nxdplug.nxdi.demo.flags"

reexport(__name__, {"AUTO": f"{_FLAGS}:AUTO", "StringOrIntegers": f"{_FLAGS}:StringOrIntegers"})
