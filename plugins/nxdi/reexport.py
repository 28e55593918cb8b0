"""How the ``nxdplug.nxdi`` modules re-export nxdplug's own objects under NxD Inference's names.

Each module of the namespace holds no code of its own: it maps NxD Inference's names to
``"module:attribute"`` references into nxdplug (imported on first use, so importing the
namespace stays light), or, for a model family, to the module of the model plugin that the
registry finds under the family's name. A public name the module does not provide raises
:class:`NotProvidedError`, naming what the module does provide; never a stand-in.
"""

from __future__ import annotations

import dis
import importlib
import sys
from collections.abc import Callable, Mapping
from types import FrameType, ModuleType
from typing import Any

from nxdplug.plugin_api import NotSupportedError, resolve_ref

NXDI_PACKAGE = "neuronx_distributed_inference"
_IMPORT_FROM = dis.opmap["IMPORT_FROM"]


class NotProvidedError(NotSupportedError, ImportError):
    """A name of NxD Inference's API that nxdplug does not implement, asked for by
    ``from nxdplug.nxdi... import Name``."""


class NotProvidedAttributeError(NotSupportedError, AttributeError):
    """The same, asked for as an attribute (``module.Name``, ``getattr``, ``hasattr``)."""


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
            from nxdplug.plugin_api import get_registry

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


class _ReexportModule(ModuleType):
    """A namespace module: its exported names are read from, and assigned to, the nxdplug
    module each comes from, so that patching one where NxD Inference's code would be patched
    changes what nxdplug calls; ``del`` (as ``mock.patch`` does on exit) undoes the latest
    assignment. Names it does not export behave as on any module."""

    __nxdi_exports__: Callable[[], dict[str, str]]
    __nxdi_replaced__: dict[str, list[Any]]

    def __getattr__(self, name: str) -> Any:
        if name == "__all__":
            return sorted(self.__nxdi_exports__())
        if name.startswith("_"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        if hasattr(self, "__path__"):  # a package: its submodules come first
            try:
                return importlib.import_module(f"{self.__name__}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{self.__name__}.{name}":
                    raise
        table = self.__nxdi_exports__()
        if name not in table:
            raise _not_provided(self.__name__, name, sorted(table), sys._getframe(1))
        return resolve_ref(table[name])

    def __setattr__(self, name: str, value: Any) -> None:
        source = self._source_of(name)
        if source is None:
            super().__setattr__(name, value)
            return
        owner, attribute = source
        self.__nxdi_replaced__.setdefault(name, []).append(getattr(owner, attribute))
        setattr(owner, attribute, value)

    def __delattr__(self, name: str) -> None:
        replaced = self.__nxdi_replaced__.get(name)
        if not replaced:
            super().__delattr__(name)
            return
        owner, attribute = self._source_of(name)  # type: ignore[misc]
        setattr(owner, attribute, replaced.pop())

    def __dir__(self) -> list[str]:
        return sorted({*vars(self), *self.__nxdi_exports__()})

    def _source_of(self, name: str) -> tuple[Any, str] | None:
        """The object and attribute an exported ``name`` is read from; None for other names."""
        if name.startswith("_"):
            return None
        ref = self.__nxdi_exports__().get(name)
        if ref is None:
            return None
        module_name, _, path = ref.partition(":")
        owner_path, _, attribute = path.rpartition(".")
        if owner_path:
            return resolve_ref(f"{module_name}:{owner_path}"), attribute
        return importlib.import_module(module_name), attribute


def _install(module: ModuleType, exports: Callable[[], dict[str, str]]) -> None:
    module.__class__ = _ReexportModule
    vars(module)["__nxdi_exports__"] = exports
    vars(module)["__nxdi_replaced__"] = {}


def _not_provided(
    module_name: str, name: str, provided: list[str], caller: FrameType
) -> NotProvidedError | NotProvidedAttributeError:
    nxdi_module = module_name.replace("nxdplug.nxdi", NXDI_PACKAGE, 1)
    listing = ", ".join(provided) or "nothing yet"
    message = (
        f"{nxdi_module}.{name} is not implemented in nxdplug: {module_name} provides {listing}. "
        "See docs/porting.md ('Porting an NxD Inference script') for what ports and what does not."
    )
    # ``from module import name`` turns an AttributeError into a bare "cannot import name",
    # losing this message, while hasattr(), getattr(m, n, default) and mock.patch need an
    # AttributeError; no class can be both (CPython's layouts of the two conflict), so the
    # statement being run decides.
    if caller.f_code.co_code[caller.f_lasti] == _IMPORT_FROM:
        error: NotProvidedError | NotProvidedAttributeError = NotProvidedError(message)
    else:
        error = NotProvidedAttributeError(message)
    error.name = name
    return error
