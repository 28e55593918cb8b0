"""The JSON form of configs, and reading and writing it safely.

Values become plain JSON the way NxD Inference writes them: a torch dtype as its name
(``"bfloat16"``), a class as a ``"module:QualName"`` reference, a nested config as a dict (through
its ``to_dict()`` or its attrs fields). The config classes turn these back into objects when they
are built from the dict, so ``load(save(config)) == config``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from nxdplug.config.classrefs import class_ref
from nxdplug.config.dtypes import dtype_name
from nxdplug.errors import ConfigError

_SCALARS = (bool, int, float, str, type(None))


def to_jsonable(value: Any, where: str) -> Any:
    """``value`` as plain JSON data; ``where`` names it in the error for an unwritable value."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, type):
        return class_ref(value)
    if isinstance(value, Mapping):
        return {
            key if isinstance(key, str) else str(key): to_jsonable(item, f"{where}.{key}")
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [to_jsonable(item, f"{where}[{i}]") for i, item in enumerate(value)]
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return to_jsonable(to_dict(), where)
    if attrs.has(type(value)):
        return {
            field.name: to_jsonable(getattr(value, field.name), f"{where}.{field.name}")
            for field in attrs.fields(type(value))
        }
    raise ConfigError(
        [
            f"{where} holds a {type(value).__name__} ({value!r}), which cannot be written to "
            "JSON; use numbers, strings, lists, dicts, torch dtypes, classes or configs"
        ]
    )


def dumps(data: Mapping[str, Any]) -> str:
    """The JSON text NxD Inference writes: indented, keys sorted."""
    return json.dumps(data, indent=2, sort_keys=True)


def parse_json_object(text: str, source: str) -> dict[str, Any]:
    """The JSON object in ``text``; anything else is a ConfigError naming ``source``."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [f"not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"], source
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            [f"expected a JSON object ({{...}}) at the top level; found {type(data).__name__}"],
            source,
        )
    return data


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object stored in the file ``path``, or a ConfigError naming the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(["the file does not exist"], str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"cannot read the file: {exc}"], str(path)) from None
    return parse_json_object(text, str(path))


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so readers never see half a file."""
    target = Path(path)
    handle, temp_name = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"
    )
    try:
        os.fchmod(handle, 0o644)  # mkstemp creates 0600; the config is not a secret
        with os.fdopen(handle, "w", encoding="utf-8") as temp:
            temp.write(text)
            temp.flush()
            os.fsync(temp.fileno())
        os.replace(temp_name, target)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
