"""Classes stored in configs, written to JSON as ``"package.module:QualName"`` references."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nxdplug.errors import ConfigError, PluginError
from nxdplug.lazy import resolve_ref


def class_ref(cls: type) -> str:
    """The ``"package.module:QualName"`` reference that :func:`to_class` reads back."""
    return f"{cls.__module__}:{cls.__qualname__}"


def to_class(value: Any) -> Any:
    """The class a reference names; classes (and anything else) are returned unchanged.

    Besides ``"module:QualName"`` strings this reads the ``{"__module__": ..., "__name__": ...}``
    form that NxD Inference writes, so its ``neuron_config.json`` files load too.
    """
    if isinstance(value, Mapping) and {"__module__", "__name__"} <= value.keys():
        value = f"{value['__module__']}:{value['__name__']}"
    if not isinstance(value, str):
        return value
    try:
        return resolve_ref(value)
    except PluginError as exc:
        raise ConfigError([f"cannot load the class {value!r}: {exc}"]) from exc


def optional_class(value: Any) -> Any:
    """Like :func:`to_class`, with ``None`` meaning "not set"."""
    return None if value is None else to_class(value)
