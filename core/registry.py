"""One table-driven lookup over every registration hook.

Callers ask ``registry.get(kind, name)`` or ``registry.records(kind)``; they never call
``pm.hook.nxdplug_...`` themselves. Each plugin's hook is called on its own, so every record is
attributed to the plugin that provided it: a name provided twice is an error naming every
provider, and an unknown name lists the valid choices.
"""

from __future__ import annotations

import difflib
import weakref
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import attrs

from nxdplug.errors import PluginError, UnknownNameError
from nxdplug.manager import NxdPlugPluginManager, get_plugin_manager
from nxdplug.types import ModelArchitecture, PluginRecord, RecordKind


@attrs.frozen
class Provided:
    """One record and the plugin that provided it."""

    record: PluginRecord
    plugin: str


class Registry:
    """A view over the registration hooks of one plugin manager, cached until it changes."""

    def __init__(self, manager: NxdPlugPluginManager) -> None:
        self.manager = manager
        self._cache: dict[str, list[Provided]] = {}
        self._generation = manager.generation

    def _provided(self, kind: str) -> list[Provided]:
        if self._generation != self.manager.generation:
            self._cache.clear()
            self._generation = self.manager.generation
        if kind not in self._cache:
            self._cache[kind] = list(self._collect(self.kind(kind)))
        return self._cache[kind]

    def kind(self, name: str) -> RecordKind:
        """The record kind called ``name`` (the core's, or one a plugin added)."""
        try:
            return self.manager.record_kinds[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown registry kind {name!r}; the kinds are: "
                f"{', '.join(self.manager.record_kinds)}"
            ) from None

    def _collect(self, kind: RecordKind) -> Iterable[Provided]:
        hook_caller = getattr(self.manager.hook, kind.hook)
        # get_hookimpls() is in registration order (pluggy *calls* them last-registered first).
        for impl in hook_caller.get_hookimpls():
            try:
                records = list(impl.function() or ())
            except Exception as exc:
                raise PluginError(
                    f"plugin {impl.plugin_name!r} failed in {kind.hook}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            for record in records:
                if not isinstance(record, kind.record_type):
                    raise PluginError(
                        f"plugin {impl.plugin_name!r} returned {type(record).__name__} from "
                        f"{kind.hook}; expected {kind.record_type.__name__} records"
                    )
                yield Provided(record, impl.plugin_name)

    def records(self, kind: str) -> list[Any]:
        """Every record of ``kind``; raises if two plugins provide the same name."""
        provided = self._provided(kind)
        self._raise_on_conflicts(self.kind(kind), provided)
        return [item.record for item in provided]

    def _origin(self, plugin: str) -> str:
        try:
            return f"{plugin!r} ({self.manager.plugin_info(plugin).origin})"
        except KeyError:
            return repr(plugin)

    def _raise_on_conflicts(self, kind: RecordKind, provided: list[Provided]) -> None:
        providers: dict[str, list[str]] = defaultdict(list)
        for item in provided:
            providers[item.record.name].append(item.plugin)
        clashes = {name: plugins for name, plugins in providers.items() if len(plugins) > 1}
        if clashes:
            details = "; ".join(
                f"{name!r} is provided by {', '.join(self._origin(p) for p in plugins)}"
                for name, plugins in sorted(clashes.items())
            )
            raise PluginError(
                f"conflicting {kind.label} names: {details}. Uninstall or deny one of them "
                "(NXDPLUG_DENY_PLUGINS=name)."
            )

    def names(self, kind: str) -> list[str]:
        return [record.name for record in self.records(kind)]

    def get(self, kind: str, name: str) -> Any:
        """The record of ``kind`` called ``name``; an unknown name lists the valid choices."""
        for record in self.records(kind):
            if record.name == name:
                return record
        label = self.kind(kind).label
        choices = self.names(kind)
        close = difflib.get_close_matches(name, choices, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        listing = ", ".join(repr(c) for c in choices) or "none are installed"
        raise UnknownNameError(f"unknown {label} {name!r}.{hint} Valid choices: {listing}.")

    def provider(self, kind: str, name: str) -> str:
        """The name of the plugin that provides the record ``name`` of ``kind``."""
        self.get(kind, name)
        return next(item.plugin for item in self._provided(kind) if item.record.name == name)

    def describe(self, record: PluginRecord) -> str:
        """How messages name ``record``: its kind, name and the plugin that provides it."""
        for kind in self.manager.record_kinds.values():
            for item in self._provided(kind.name):
                if item.record is record:
                    return f"{kind.label} {record.name!r} of plugin {self._origin(item.plugin)}"
        return f"{type(record).__name__} {record.name!r} (registered by no plugin)"

    def provided_by(self, plugin: str) -> dict[str, list[str]]:
        """What ``plugin`` provides, per kind (no conflict check: this is for listings)."""
        result: dict[str, list[str]] = {}
        for kind in self.manager.record_kinds:
            names = [item.record.name for item in self._provided(kind) if item.plugin == plugin]
            if names:
                result[kind] = names
        return result

    def find_architecture(
        self, hf_architectures: Iterable[str], model_type: str | None
    ) -> ModelArchitecture:
        """The model plugin serving an HF config's ``architectures`` (first) or ``model_type``."""
        architectures = list(hf_architectures)
        records = self.records("model_architectures")
        for arch in architectures:
            for record in records:
                if arch in record.hf_architectures:
                    return record
        for record in records:
            if model_type is not None and record.model_type == model_type:
                return record
        served = sorted({a for r in records for a in r.hf_architectures})
        raise UnknownNameError(
            f"no installed model plugin serves architectures={architectures} "
            f"model_type={model_type!r}. Installed model plugins serve: {', '.join(served)}. "
            "Install a plugin for this model family, or check `nxdplug plugins list`."
        )


_registries: weakref.WeakKeyDictionary[NxdPlugPluginManager, Registry] = weakref.WeakKeyDictionary()


def get_registry() -> Registry:
    """The registry over the process-wide plugin manager."""
    manager = get_plugin_manager()
    if manager not in _registries:
        _registries[manager] = Registry(manager)
    return _registries[manager]
