"""NxD Inference's ``modules.autobucketing``: bucket lists."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(__name__, {"generate_buckets": "nxdplug.config:generate_buckets"})
