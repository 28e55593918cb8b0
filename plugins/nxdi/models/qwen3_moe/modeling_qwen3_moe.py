"""NxD Inference's ``models.qwen3_moe.modeling_qwen3_moe``.

The public names of the module of the model plugin registered as ``qwen3_moe``, found through the
registry on first use.
"""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport_model_module

reexport_model_module(__name__)
