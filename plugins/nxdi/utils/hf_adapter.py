"""NxD Inference's ``utils.hf_adapter``: the generation adapter and the config loader."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(
    __name__,
    {
        "HuggingFaceGenerationAdapter": "nxdplug:HuggingFaceGenerationAdapter",
        "load_pretrained_config": "nxdplug.config:load_pretrained_config",
    },
)
