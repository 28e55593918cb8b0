"""NxD Inference's ``utils.accuracy``: its accuracy helpers under its names and signatures, over
nxdplug applications, with HF transformers on the CPU as the reference. (``logit_validation``
is the one NxD Inference imports there from ``torch_neuronx``.)"""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(
    __name__,
    {
        "TEST_PROMPT": "nxdplug.runtime.accuracy:TEST_PROMPT",
        "get_generate_outputs": "nxdplug.runtime.accuracy:get_generate_outputs",
        "check_accuracy": "nxdplug.runtime.accuracy:check_accuracy",
        "generate_expected_logits": "nxdplug.runtime.logit_accuracy:generate_expected_logits",
        "check_accuracy_logits": "nxdplug.runtime.logit_accuracy:check_accuracy_logits",
        "check_accuracy_logits_v2": "nxdplug.runtime.logit_accuracy:check_accuracy_logits_v2",
        "logit_validation": "nxdplug.runtime.logit_validation:logit_validation",
    },
)
