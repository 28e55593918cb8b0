"""The plugin manager: finds plugins through one entry-point group, built-ins included.

Loading is tolerant: a plugin that fails to import is recorded with its distribution, version and
error, and everything else keeps working. ``NXDPLUG_STRICT_PLUGINS=1`` makes such a failure fatal.
``NXDPLUG_ALLOW_PLUGINS`` (only these) and ``NXDPLUG_DENY_PLUGINS`` (all but these) take
comma-separated entry-point names.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import pluggy

from nxdplug.errors import PluginError
from nxdplug.hookspecs import PROJECT_NAME, SPEC_CLASSES

ENTRY_POINT_GROUP = "nxdplug"
STRICT_ENV = "NXDPLUG_STRICT_PLUGINS"
ALLOW_ENV = "NXDPLUG_ALLOW_PLUGINS"
DENY_ENV = "NXDPLUG_DENY_PLUGINS"


@attrs.frozen
class PluginInfo:
    """What is known about one plugin: where it came from and whether it is in use."""

    name: str
    distribution: str | None
    version: str | None
    status: str  # "active", "disabled" or "failed"
    module: str | None = None
    error: str | None = None

    @property
    def origin(self) -> str:
        if self.distribution is None:
            return "registered in-process"
        return f"{self.distribution} {self.version}"


def _names_from_env(variable: str) -> frozenset[str] | None:
    raw = os.environ.get(variable)
    if raw is None or not raw.strip():
        return None
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def _strict_from_env() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


class NxdPlugPluginManager(pluggy.PluginManager):
    """A pluggy manager that keeps a :class:`PluginInfo` per plugin and a change counter."""

    def __init__(
        self,
        *,
        strict: bool | None = None,
        allow: frozenset[str] | None = None,
        deny: frozenset[str] | None = None,
    ) -> None:
        super().__init__(PROJECT_NAME)
        for spec_class in SPEC_CLASSES:
            self.add_hookspecs(spec_class)
        self.strict = _strict_from_env() if strict is None else strict
        self.allow = _names_from_env(ALLOW_ENV) if allow is None else allow
        self.deny = (_names_from_env(DENY_ENV) or frozenset()) if deny is None else deny
        self.generation = 0
        self._infos: dict[str, PluginInfo] = {}

    def register(self, plugin: Any, name: str | None = None) -> str | None:
        registered = super().register(plugin, name)
        self.generation += 1
        return registered

    def unregister(self, plugin: Any = None, name: str | None = None) -> Any:
        removed = super().unregister(plugin, name)
        self.generation += 1
        return removed

    def register_plugin(
        self,
        plugin: Any,
        name: str,
        *,
        distribution: str | None = None,
        version: str | None = None,
    ) -> None:
        """Register ``plugin`` under ``name`` and record where it came from."""
        if self.has_plugin(name):
            existing = self._infos.get(name)
            origin = existing.origin if existing else "unknown origin"
            raise PluginError(
                f"a plugin named {name!r} is already registered ({origin}); "
                "entry-point names must be unique across installed distributions"
            )
        self.register(plugin, name=name)
        self._infos[name] = PluginInfo(
            name=name,
            distribution=distribution,
            version=version,
            status="active",
            module=getattr(plugin, "__name__", type(plugin).__name__),
        )
        self.check_pending()

    def unregister_plugin(self, name: str) -> None:
        """Remove a plugin registered with :meth:`register_plugin`."""
        self.unregister(name=name)
        self._infos.pop(name, None)

    def load_entrypoints(self, group: str = ENTRY_POINT_GROUP) -> None:
        """Load every entry point of ``group``, honouring the allow- and deny-lists."""
        seen: set[str] = set()
        for entry_point in sorted(metadata.entry_points(group=group), key=lambda ep: ep.name):
            if entry_point.name in seen:
                continue  # the same distribution found twice on sys.path
            seen.add(entry_point.name)
            self._load_entrypoint(entry_point)

    def _load_entrypoint(self, entry_point: metadata.EntryPoint) -> None:
        dist = entry_point.dist
        distribution = dist.metadata["Name"] if dist is not None else None
        version = dist.version if dist is not None else None
        base = {"name": entry_point.name, "distribution": distribution, "version": version}
        if self._is_disabled(entry_point.name):
            self._infos[entry_point.name] = PluginInfo(
                **base, status="disabled", module=entry_point.value
            )
            return
        try:
            plugin = entry_point.load()
            self.register_plugin(
                plugin, entry_point.name, distribution=distribution, version=version
            )
        except Exception as exc:
            message = (
                f"plugin {entry_point.name!r} from {distribution} {version} "
                f"({entry_point.value}) failed to load: {type(exc).__name__}: {exc}"
            )
            if self.strict:
                raise PluginError(f"{message} ({STRICT_ENV} is set)") from exc
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            self._infos[entry_point.name] = PluginInfo(
                **base,
                status="failed",
                module=entry_point.value,
                error=f"{type(exc).__name__}: {exc}",
            )

    def _is_disabled(self, name: str) -> bool:
        if self.allow is not None and name not in self.allow:
            return True
        return name in self.deny

    def plugin_infos(self) -> list[PluginInfo]:
        """Every plugin seen, active, disabled or failed, sorted by name."""
        return [self._infos[name] for name in sorted(self._infos)]

    def plugin_info(self, name: str) -> PluginInfo:
        return self._infos[name]


def create_plugin_manager(*, load_entrypoints: bool = True, **options: Any) -> NxdPlugPluginManager:
    """A new manager; with ``load_entrypoints`` it holds every installed plugin."""
    manager = NxdPlugPluginManager(**options)
    if load_entrypoints:
        manager.load_entrypoints()
    return manager


_lock = threading.Lock()
_manager: NxdPlugPluginManager | None = None


def get_plugin_manager() -> NxdPlugPluginManager:
    """The process-wide manager, created on first use."""
    global _manager
    with _lock:
        if _manager is None:
            _manager = create_plugin_manager()
        return _manager


@contextmanager
def use_plugin_manager(manager: NxdPlugPluginManager) -> Iterator[NxdPlugPluginManager]:
    """Make ``manager`` the process-wide manager inside the block (tests, isolated tools)."""
    global _manager
    with _lock:
        previous, _manager = _manager, manager
    try:
        yield manager
    finally:
        with _lock:
            _manager = previous
