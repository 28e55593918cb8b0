"""NxD Inference's ``utils.accuracy``: its accuracy helpers under its names and signatures, over
nxdplug applications, with HF transformers on the CPU as the reference. (``logit_validation``
is the one NxD Inference imports there from ``torch_neuronx``.)"""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(
    __name__,
    {
        "TEST_PROMPT": "nxdplug.generation.accuracy:TEST_PROMPT",
        "get_generate_outputs": "nxdplug.generation.accuracy:get_generate_outputs",
        "check_accuracy": "nxdplug.generation.accuracy:check_accuracy",
        "generate_expected_logits": "nxdplug.generation.logit_accuracy:generate_expected_logits",
        "check_accuracy_logits": "nxdplug.generation.logit_accuracy:check_accuracy_logits",
        "check_accuracy_logits_v2": "nxdplug.generation.logit_accuracy:check_accuracy_logits_v2",
        # As imported where check_accuracy_logits calls it, so that patching it here reaches
        # that call (NxD Inference's utils.accuracy imports it from torch_neuronx).
        "logit_validation": "nxdplug.generation.logit_accuracy:logit_validation",
        "prepare_inputs_from_prompt": "nxdplug.generation.accuracy:prepare_inputs_from_prompt",
        "shift_inputs_by_offset": "nxdplug.generation.accuracy:shift_inputs_by_offset",
        # What NxD Inference's utils.accuracy imports from its other modules.
        "HuggingFaceGenerationAdapter": "nxdplug.generation.accuracy:HuggingFaceGenerationAdapter",
        "LogitMatchingValidationError": (
            "nxdplug.generation.logit_accuracy:LogitMatchingValidationError"
        ),
    },
)
