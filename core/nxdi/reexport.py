"""How the ``nxdplug.nxdi`` modules re-export nxdplug's own objects under NxD Inference's names.

Each module of the namespace holds no code of its own: it maps NxD Inference's names to
``"module:attribute"`` references into nxdplug (imported on first use, so importing the
namespace stays light), or, for a model family, to the module of the model plugin that the
registry finds under the family's name. A public name the module does not provide raises
:class:`NotProvidedError`, naming what the module does provide; never a stand-in.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from nxdplug.errors import NotSupportedError
from nxdplug.lazy import resolve_ref

NXDI_PACKAGE = "neuronx_distributed_inference"


class NotProvidedError(NotSupportedError, ImportError):
    """A name of NxD Inference's API that nxdplug does not implement.

    An ImportError, so that ``from nxdplug.nxdi... import Name`` shows this message (Python
    replaces an AttributeError there with a bare "cannot import name").
    """


def reexport(module_name: str, exports: Mapping[str, str]) -> None:
    """Make ``module_name`` serve ``exports`` (NxD Inference name -> ``"module:attribute"``)."""
    _install(sys.modules[module_name], lambda: dict(exports))


def reexport_model_module(module_name: str) -> None:
    """Make ``module_name`` (``nxdplug.nxdi.models.<family>.modeling_<family>``) serve the public
    names of the module of the model plugin registered as ``<family>``.

    The plugin is found through the registry when a name is first asked for, so the core names
    no model package and importing the namespace imports no model code.
    """
    family = module_name.split(".")[-2]
    source: list[ModuleType] = []

    def source_module() -> ModuleType:
        if not source:
            from nxdplug.registry import get_registry

            record = get_registry().get("model_architectures", family)
            source.append(importlib.import_module(record.application.partition(":")[0]))
        return source[0]

    def exports() -> dict[str, str]:
        module = source_module()
        names = getattr(module, "__all__", None) or [
            name
            for name, value in vars(module).items()
            if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
        ]
        return {name: f"{module.__name__}:{name}" for name in names}

    _install(sys.modules[module_name], exports)


def _install(module: ModuleType, exports: Callable[[], dict[str, str]]) -> None:
    def __getattr__(name: str) -> Any:
        if name == "__all__":
            return sorted(exports())
        if name.startswith("_"):
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
        if hasattr(module, "__path__"):  # a package: its submodules come first
            try:
                return importlib.import_module(f"{module.__name__}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{module.__name__}.{name}":
                    raise
        table = exports()
        if name not in table:
            raise _not_provided(module.__name__, name, sorted(table))
        value = resolve_ref(table[name])
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(module), *exports()})

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    module.__dir__ = __dir__  # type: ignore[method-assign]


def _not_provided(module_name: str, name: str, provided: list[str]) -> NotProvidedError:
    nxdi_module = module_name.replace("nxdplug.nxdi", NXDI_PACKAGE, 1)
    listing = ", ".join(provided) or "nothing yet"
    error = NotProvidedError(
        f"{nxdi_module}.{name} is not implemented in nxdplug: {module_name} provides {listing}. "
        "See the README's 'Porting an NxD Inference script' for what ports and what does not."
    )
    error.name = name
    return error
