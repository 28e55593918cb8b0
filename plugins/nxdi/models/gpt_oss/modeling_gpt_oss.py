"""NxD Inference's ``models.gpt_oss.modeling_gpt_oss``.

The public names of the module of the model plugin registered as ``gpt_oss``, found through the
registry on first use.
"""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport_model_module

reexport_model_module(__name__)
