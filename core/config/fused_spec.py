"""Fused speculation: the target and draft models compiled into one (EAGLE uses it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from nxdplug.config.classrefs import optional_class, to_class

if TYPE_CHECKING:
    from nxdplug.config.inference_config import InferenceConfig


@attrs.define
class FusedSpecNeuronConfig:
    """The model class to fuse, the draft model's config and where its checkpoint is.

    ``worker_cls`` (a NeuronBaseModel subclass) is written to JSON as ``"module:QualName"`` and
    imported again when the config is loaded, as is ``draft_model_cls`` (the draft's
    application class, optional as in NxD Inference). ``draft_config`` is an InferenceConfig; a
    dict is turned into one by the InferenceConfig that holds this object, which knows its own
    class.
    """

    worker_cls: Any = attrs.field(converter=to_class)
    draft_config: InferenceConfig | None = None
    draft_model_path: str | None = None
    draft_model_cls: Any = attrs.field(default=None, converter=optional_class)
