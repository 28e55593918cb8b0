"""NxD Inference's ``models.model_base``: the model base classes a model family subclasses."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(
    __name__,
    {
        "NeuronBaseModel": "nxdplug.runtime.model_base:NeuronBaseModel",
        "NeuronBaseForCausalLM": "nxdplug.runtime.application:NeuronBaseForCausalLM",
    },
)
