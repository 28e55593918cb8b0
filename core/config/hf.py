"""Model attributes from a checkpoint folder or a transformers config: ``load_pretrained_config``.

The folder is read by the first registered config loader (kind ``config_loaders``) whose file is
in it; the built-in one reads HF ``config.json``. Any loader's result is applied the same way:
the checkpoint's dtype goes to ``neuron_config.torch_dtype`` unless the user chose one, the
``attribute_map`` extends the config's aliases, and everything else becomes an attribute. A
``quantization_config`` sets the quantization settings its format means
(:mod:`.checkpoint_format`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nxdplug.config.checkpoint_format import apply_checkpoint_format
from nxdplug.config.neuron_config import NeuronConfig
from nxdplug.errors import ConfigError
from nxdplug.registry import get_registry

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from nxdplug.config.inference_config import InferenceConfig

# Keys of a loader's result that would replace parts of the InferenceConfig itself.
_NOT_MODEL_ATTRIBUTES = frozenset({"neuron_config", "fused_spec_config"})
_DTYPE_KEYS = ("dtype", "torch_dtype")  # transformers 5 and 4 spellings


def load_pretrained_config(
    model_path: str | os.PathLike[str] | None = None,
    hf_config: PretrainedConfig | None = None,
) -> Callable[[InferenceConfig], None]:
    """A ``load_config`` hook that copies a model's attributes into an InferenceConfig.

    Give either the checkpoint folder ``model_path`` or a transformers ``hf_config``. With a
    folder, the config's ``_name_or_path`` is set to it.
    """
    if (model_path is None) == (hf_config is None):
        raise ValueError("load_pretrained_config takes exactly one of model_path and hf_config")

    def load_config(config: InferenceConfig) -> None:
        if hf_config is not None:
            _apply_model_attributes(config, pretrained_config_attributes(hf_config))
        else:
            _apply_model_attributes(config, read_model_attributes(model_path))
            config._name_or_path = str(model_path)
        apply_checkpoint_format(config, model_path)

    return load_config


def read_model_attributes(model_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The model attributes the first config loader with a file in ``model_path`` reads."""
    folder = Path(model_path)
    if not folder.is_dir():
        raise ConfigError(["the model folder does not exist (or is not a folder)"], str(folder))
    loaders = get_registry().records("config_loaders")
    for record in loaders:
        if any((folder / name).is_file() for name in record.filenames):
            attributes = record.load("loader")(model_path)
            if not isinstance(attributes, Mapping):
                raise ConfigError(
                    [
                        f"config loader {record.name!r} returned {type(attributes).__name__}; "
                        "a config loader must return a dict of attributes"
                    ],
                    str(folder),
                )
            return dict(attributes)
    looked_for = ", ".join(name for record in loaders for name in record.filenames)
    raise ConfigError(
        [
            f"no model configuration file in this folder; looked for: {looked_for or 'nothing'} "
            "(the files the installed config loaders read). Give the folder of an HF checkpoint "
            "or install a config-loader plugin for this format."
        ],
        str(folder),
    )


def pretrained_config_attributes(
    hf_config: PretrainedConfig, raw: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A transformers config's attributes, over the ``raw`` dict it was read from, if any.

    The result has the class's ``attribute_map`` under ``"attribute_map"``, the checkpoint's
    ``transformers_version`` (``to_dict`` writes the installed one), the rope keys of both
    transformers generations (:func:`with_rope_aliases`), and is plain JSON data, so that a
    config saved with it loads back equal.
    """
    attributes = {**(raw or {}), **hf_config.to_dict()}
    version = getattr(hf_config, "transformers_version", None)
    if version:
        attributes["transformers_version"] = version
    attributes["attribute_map"] = dict(getattr(hf_config, "attribute_map", None) or {})
    # Through JSON once: int keys (id2label) become strings and tuples lists, as after a save.
    return json.loads(json.dumps(with_rope_aliases(attributes), default=str))


def with_rope_aliases(attributes: dict[str, Any]) -> dict[str, Any]:
    """Fill ``rope_theta`` and ``rope_scaling`` from transformers 5's ``rope_parameters``.

    Transformers 5 writes ``rope_parameters={"rope_theta": ..., "rope_type": ..., ...}`` where
    transformers 4 had ``rope_theta`` and ``rope_scaling`` (None for the default rope). Missing or
    None plain keys are derived, so model code can read either form. Per-layer-type
    ``rope_parameters`` (a dict of dicts) are left alone.
    """
    params = attributes.get("rope_parameters")
    if not isinstance(params, Mapping) or "rope_theta" not in params:
        return attributes
    if attributes.get("rope_theta") is None:
        attributes["rope_theta"] = params["rope_theta"]
    if attributes.get("rope_scaling") is None and params.get("rope_type", "default") != "default":
        attributes["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    attributes.setdefault("rope_scaling", None)
    return attributes


def _apply_model_attributes(config: InferenceConfig, attributes: Mapping[str, Any]) -> None:
    attributes = dict(attributes)
    dtypes = [attributes.pop(key, None) for key in _DTYPE_KEYS]
    checkpoint_dtype = next((value for value in dtypes if value is not None), None)
    if checkpoint_dtype is not None and isinstance(config.neuron_config, NeuronConfig):
        config.neuron_config.apply_checkpoint_dtype(checkpoint_dtype)
    aliases = attributes.pop("attribute_map", None)
    if aliases:
        config.attribute_map = {**config.attribute_map, **aliases}
    for name, value in attributes.items():
        if name not in _NOT_MODEL_ATTRIBUTES:
            setattr(config, name, value)
