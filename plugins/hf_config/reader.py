"""Reads an HF ``config.json`` into model attributes, through transformers when it knows the model.

For a ``model_type`` transformers knows, its config class fills the defaults the file leaves
out (``head_dim``, ``rope_parameters``, ...) and contributes its ``attribute_map``; for any other
model the file's own keys are the attributes.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from nxdplug.plugin_api import (
    ConfigError,
    pretrained_config_attributes,
    read_json_object,
    with_rope_aliases,
)

CONFIG_JSON = "config.json"


def read_hf_config(model_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The model attributes in ``model_path/config.json``; a malformed file is a ConfigError."""
    config_file = Path(model_path) / CONFIG_JSON
    raw = read_json_object(config_file)
    config_class = _transformers_config_class(raw.get("model_type"))
    if config_class is None:
        return with_rope_aliases(raw)
    try:
        hf_config = config_class.from_dict(copy.deepcopy(raw))  # it edits nested dicts
    except Exception as exc:  # transformers' validators raise many types (strict dataclasses...)
        raise ConfigError(
            [f"transformers' {config_class.__name__} cannot read it: {exc}"], str(config_file)
        ) from exc
    return pretrained_config_attributes(hf_config, raw)


def _transformers_config_class(model_type: Any) -> Any:
    from transformers import CONFIG_MAPPING  # heavy: imported only when a config is read

    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type]
    return None
