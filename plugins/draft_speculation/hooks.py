"""Speculative decoding with a draft model (``speculation_length=k``), and prompt lookup.

The target gets a speculation sub-model that takes k+1 tokens per row and returns the logits
of each; ``HuggingFaceGenerationAdapter.generate(assistant_model=draft)`` drafts with a second
application, ``generate(prompt_lookup_num_tokens=n)`` looks the drafts up in the sequence.
Fused speculation (``enable_fused_speculation``, EAGLE) is another plugin's mode.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from nxdplug.hookspecs import hookimpl
from nxdplug.types import SpeculationMode

if TYPE_CHECKING:
    from nxdplug.config import InferenceConfig
    from nxdplug.runtime.model_wrapper import ModelWrapper

NXDPLUG_API_VERSION = 1


@hookimpl
def nxdplug_speculation_modes() -> Iterable[SpeculationMode]:
    yield SpeculationMode(
        name="draft-model",
        implementation="nxdplug.plugins.draft_speculation.speculator:ChainSpeculator",
        enabled_by=("speculation_length",),
        disabled_by=("enable_fused_speculation",),
        description="k tokens from a draft model or prompt lookup, verified in one target call",
    )


@hookimpl
def nxdplug_validate_config(config: InferenceConfig) -> Iterable[str]:
    neuron_config = config.neuron_config
    if neuron_config.on_device_sampling_config is not None:
        yield (
            "speculation_length with a draft model verifies the drafts on the host from the "
            "target's logits; set on_device_sampling_config=None (fused speculation samples on "
            "the device)"
        )


@hookimpl
def nxdplug_add_submodels(application: Any, config: InferenceConfig) -> Iterable[ModelWrapper]:
    from nxdplug.runtime.model_wrapper import SPECULATION_MODEL_TAG, ModelWrapper

    tokens = config.neuron_config.speculation_length + 1
    application.speculation_model = ModelWrapper(
        config, application._model_cls, tag=SPECULATION_MODEL_TAG, tokens_per_step=tokens
    )
    yield application.speculation_model
