"""Quantized checkpoints other tools write (GPTQ, AWQ, compressed-tensors, ...), found as
transformers finds them: by ``config.json``'s ``quantization_config.quant_method``.

The registered format (kind ``quantized_checkpoint_formats``) that reads that method decides
the NeuronConfig's quantization settings when the config is loaded from the checkpoint folder
(:func:`apply_checkpoint_format`), and converts the stored tensors when the weights are
read (:func:`checkpoint_format_reader`).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from nxdplug.checkpoint.state_dict import checkpoint_tensor_names
from nxdplug.config.checkpoint_settings import agree_with_checkpoint
from nxdplug.errors import ConfigError
from nxdplug.registry import get_registry

if TYPE_CHECKING:
    from nxdplug.config.inference_config import InferenceConfig

ORIGIN = "config.json's quantization_config"


class CheckpointFormatReader(Protocol):
    """What a ``QuantizedCheckpointFormat`` record's ``reader`` builds."""

    def __init__(self, quantization_config: Mapping[str, Any], tensor_names: Collection[str]): ...

    def settings(self) -> Mapping[str, Any]:
        """The NeuronConfig settings the checkpoint means."""

    def convert(
        self, state_dict: dict[str, torch.Tensor], config: InferenceConfig
    ) -> dict[str, torch.Tensor]:
        """The stored tensors in the layout of those settings."""


def checkpoint_format_reader(
    config: InferenceConfig, tensor_names: Collection[str] = ()
) -> CheckpointFormatReader | None:
    """The reader of the checkpoint's quantization format; None for a checkpoint without
    ``quantization_config``. A method no installed plugin reads is a ConfigError."""
    declared = getattr(config, "quantization_config", None)
    if not declared:
        return None
    if not isinstance(declared, Mapping):
        declared = declared.to_dict()  # a transformers QuantizationConfigMixin
    method = declared.get("quant_method")
    formats = get_registry().records("quantized_checkpoint_formats")
    for record in formats:
        if method in record.quant_methods:
            return record.load("reader")(declared, tensor_names)
    known = ", ".join(sorted(repr(m) for record in formats for m in record.quant_methods))
    raise ConfigError(
        [
            f"quantization_config.quant_method is {method!r}, which no installed plugin reads "
            f"(read: {known or 'none'}); dequantize the checkpoint with the tool that wrote it "
            "(or transformers: from_pretrained, then save_pretrained of the dequantized "
            "model), or install a plugin that reads it"
        ],
        str(getattr(config, "_name_or_path", None) or "config.json"),
    )


def apply_checkpoint_format(
    config: InferenceConfig, model_path: str | os.PathLike[str] | None
) -> None:
    """Make ``config.neuron_config`` agree with the checkpoint's quantization format: settings
    left at their defaults take the format's, settings given otherwise must agree (a
    ConfigError names each contradiction). A quantized format's weights are read from
    ``model_path`` itself (``quantized_checkpoints_path``)."""
    if not getattr(config, "quantization_config", None):
        return
    names = checkpoint_tensor_names(model_path) if model_path is not None else ()
    reader = checkpoint_format_reader(config, names)
    settings = dict(reader.settings())
    if settings.get("quantized") and model_path is not None:
        settings["quantized_checkpoints_path"] = str(model_path)
    config.neuron_config = agree_with_checkpoint(
        config.neuron_config,
        {name: (value, ORIGIN) for name, value in settings.items()},
        str(model_path or "the checkpoint"),
    )
