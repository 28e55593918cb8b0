"""nxdplug: the NxD Inference API as a small core plus plugins.

The public names are imported on first use, so ``import nxdplug`` (and listing plugins) stays
light: torch and model code load only when a config or model is touched.
"""

from __future__ import annotations

from nxdplug.hookspecs import hookimpl
from nxdplug.lazy import lazy_attribute_getter

__version__ = "0.1.0"

_LAZY_EXPORTS = {
    "NeuronConfig": "nxdplug.config",
    "InferenceConfig": "nxdplug.config",
    "MoENeuronConfig": "nxdplug.config",
    "FusedSpecNeuronConfig": "nxdplug.config",
    "OnDeviceSamplingConfig": "nxdplug.config",
    "LoraServingConfig": "nxdplug.config",
    "ChunkedPrefillConfig": "nxdplug.config",
    "load_pretrained_config": "nxdplug.config",
    "HuggingFaceGenerationAdapter": "nxdplug.generation.hf_adapter",
    "NeuronApplicationBase": "nxdplug.runtime.application",
    "NeuronBaseForCausalLM": "nxdplug.runtime.application",
    "NeuronBaseModel": "nxdplug.runtime.model_base",
    "ModelWrapper": "nxdplug.runtime.model_wrapper",
    "from_pretrained": "nxdplug.runtime.application",
}

__all__ = ["__version__", "hookimpl", *_LAZY_EXPORTS]


__getattr__ = lazy_attribute_getter(__name__, _LAZY_EXPORTS)


def __dir__() -> list[str]:
    return sorted(__all__)
