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
        # As imported where check_accuracy_logits calls it, so that patching it here reaches
        # that call (NxD Inference's utils.accuracy imports it from torch_neuronx).
        "logit_validation": "nxdplug.runtime.logit_accuracy:logit_validation",
        "prepare_inputs_from_prompt": "nxdplug.runtime.accuracy:prepare_inputs_from_prompt",
        "shift_inputs_by_offset": "nxdplug.runtime.accuracy:shift_inputs_by_offset",
        # What NxD Inference's utils.accuracy imports from its other modules.
        "HuggingFaceGenerationAdapter": "nxdplug.runtime.accuracy:HuggingFaceGenerationAdapter",
        "LogitMatchingValidationError": (
            "nxdplug.runtime.logit_accuracy:LogitMatchingValidationError"
        ),
    },
)
