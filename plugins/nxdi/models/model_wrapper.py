"""NxD Inference's ``models.model_wrapper``: ModelWrapper (one phase with its buckets and
padding, ``pad_inputs`` included) and the phases' tags (Medusa's, ``MEDUSA_MODEL_TAG``, is in
its plugin's ``submodels`` module)."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

_WRAPPER = "nxdplug.runtime.model_wrapper"

reexport(
    __name__,
    {
        name: f"{_WRAPPER}:{name}"
        for name in (
            "ModelWrapper",
            "CONTEXT_ENCODING_MODEL_TAG",
            "TOKEN_GENERATION_MODEL_TAG",
            "SPECULATION_MODEL_TAG",
            "FUSED_SPECULATION_MODEL_TAG",
        )
    },
)
