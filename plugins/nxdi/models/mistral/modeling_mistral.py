"""NxD Inference's ``models.mistral.modeling_mistral``.

The public names of the module of the model plugin registered as ``mistral``, found through the
registry on first use.
"""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport_model_module

reexport_model_module(__name__)
