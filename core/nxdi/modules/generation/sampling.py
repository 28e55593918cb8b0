"""NxD Inference's ``modules.generation.sampling``.

nxdplug samples on device through its sampling plugin (``OnDeviceSamplingConfig`` and
``generate()`` keywords), which offers no module-level API under NxD Inference's names yet:
every name here raises NotProvidedError.
"""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(__name__, {})
