"""The pipeline callbacks of draft-model speculation: the target's verification sub-model."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from nxdplug.plugin_api import SPECULATION_MODEL_TAG, ModelWrapper

if TYPE_CHECKING:
    from nxdplug.plugin_api import PipelineContext


def validate(context: PipelineContext) -> Iterable[str]:
    if context.neuron_config.on_device_sampling_config is not None:
        yield (
            "speculation_length with a draft model verifies the drafts on the host from the "
            "target's logits; set on_device_sampling_config=None (fused speculation samples on "
            "the device)"
        )


def add_submodels(context: PipelineContext) -> Iterable[ModelWrapper]:
    """A sub-model taking k+1 tokens per row (spec_batch_size rows), which
    ``application.forward`` routes k+1-token steps to."""
    neuron_config = context.neuron_config
    yield ModelWrapper(
        context.config,
        context.model_cls,
        tag=SPECULATION_MODEL_TAG,
        tokens_per_step=neuron_config.speculation_length + 1,
        batch_size=neuron_config.spec_batch_size,
    )
