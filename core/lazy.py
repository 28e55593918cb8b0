"""Lazy ``"module:attribute"`` references, so that listing plugins imports no model code."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from typing import Any

from nxdplug.errors import PluginError

_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_ref(value: str) -> bool:
    """True when ``value`` has the ``package.module:attribute`` form."""
    return bool(_REF.match(value))


def resolve_ref(ref: str) -> Any:
    """Import ``package.module`` and return its (possibly dotted) ``attribute``."""
    if not is_ref(ref):
        raise PluginError(f"{ref!r} is not a 'package.module:attribute' reference")
    module_name, _, attr_path = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"cannot import {module_name!r} (from reference {ref!r}): {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise PluginError(f"{module_name!r} has no attribute {attr_path!r} ({ref!r})") from exc
    return obj


def lazy_attribute_getter(module_name: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module's ``__getattr__`` that imports each name of ``exports`` (name -> module) on
    first use and keeps it in the module, so that the module's own import stays light."""
    namespace = vars(importlib.import_module(module_name))

    def get(name: str) -> Any:
        source = exports.get(name)
        if source is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        namespace[name] = value = getattr(importlib.import_module(source), name)
        return value

    return get
