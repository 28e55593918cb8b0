"""NxD Inference's ``models.application_base``: the application base class."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(__name__, {"NeuronApplicationBase": "nxdplug.runtime.application:NeuronApplicationBase"})
