"""NxD Inference's ``modules.lora_serving.config``."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(__name__, {"LoraServingConfig": "nxdplug.config:LoraServingConfig"})
