"""The plugin manager: finds plugins through one entry-point group, built-ins included.

Loading is tolerant: a plugin that fails to import is recorded with its distribution, version and
error, and everything else keeps working. ``NXDPLUG_STRICT_PLUGINS=1`` makes such a failure fatal.
``NXDPLUG_ALLOW_PLUGINS`` (only these) and ``NXDPLUG_DENY_PLUGINS`` (all but these) take
comma-separated entry-point names.
"""

from __future__ import annotations

import difflib
import importlib.metadata as metadata
import os
import re
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import pluggy

from nxdplug.errors import PluginError
from nxdplug.hookspecs import (
    API_VERSION,
    API_VERSION_ATTRIBUTE,
    PROJECT_NAME,
    RECORD_KINDS,
    SPEC_CLASSES,
)
from nxdplug.types import RecordKind

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
    api_version: int | None = None  # what the plugin declares it was written for

    @property
    def origin(self) -> str:
        if self.distribution is None:
            return "registered in-process"
        return f"{self.distribution} {self.version}"


def _declared_api_version(plugin: Any, name: str, origin: str) -> int | None:
    declared = getattr(plugin, API_VERSION_ATTRIBUTE, None)
    if declared is None:
        return None
    try:
        declared = int(declared)
    except (TypeError, ValueError):
        raise PluginError(
            f"plugin {name!r} ({origin}) sets {API_VERSION_ATTRIBUTE}={declared!r}, which is not "
            f"an integer; the current plugin API version is {API_VERSION}"
        ) from None
    if declared != API_VERSION:
        newer = "a newer" if declared > API_VERSION else "an older"
        raise PluginError(
            f"plugin {name!r} ({origin}) was written for nxdplug plugin API {declared}, but this "
            f"nxdplug provides API {API_VERSION} ({newer} API than installed); install a version "
            "of that package made for this nxdplug, or an nxdplug that provides its API"
        )
    return declared


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
        self.spec_classes: list[type] = []
        self.record_kinds: dict[str, RecordKind] = {kind.name: kind for kind in RECORD_KINDS}
        for spec_class in SPEC_CLASSES:
            self.add_plugin_hookspecs(spec_class)
        self.hook.nxdplug_add_hookspecs.call_historic(kwargs={"pluginmanager": self})
        self.strict = _strict_from_env() if strict is None else strict
        self.allow = _names_from_env(ALLOW_ENV) if allow is None else allow
        self.deny = (_names_from_env(DENY_ENV) or frozenset()) if deny is None else deny
        self.generation = 0
        self._infos: dict[str, PluginInfo] = {}

    def add_plugin_hookspecs(self, spec_class: type, *kinds: RecordKind) -> None:
        """Add the hooks declared on ``spec_class`` and the record kinds their registration
        hooks return (``nxdplug_add_hookspecs``); a kind's name may be taken once."""
        for kind in kinds:
            if kind.name in self.record_kinds:
                raise PluginError(f"the record kind {kind.name!r} is declared twice")
        self.add_hookspecs(spec_class)
        self.spec_classes.append(spec_class)
        self.record_kinds.update((kind.name, kind) for kind in kinds)

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
        check_hooks: bool = True,
    ) -> None:
        """Register ``plugin`` under ``name`` and record where it came from.

        A plugin written for another plugin API version, a hook implementation whose name
        matches no hook, or whose arguments are not the hook's, is refused: nothing of it stays
        registered, and the error says which package it is and what to do. Without
        ``check_hooks``, names that match no hook yet are left for :meth:`refuse_unknown_hooks`
        (a plugin may implement hooks that a plugin loaded after it adds).
        """
        origin = f"{distribution} {version}" if distribution else "registered in-process"
        if self.has_plugin(name):
            existing = self._infos.get(name)
            raise PluginError(
                f"a plugin named {name!r} is already registered "
                f"({existing.origin if existing else 'unknown origin'}); entry-point names must "
                f"be unique across installed distributions, so rename the one from {origin}"
            )
        declared = _declared_api_version(plugin, name, origin)
        try:
            self.register(plugin, name=name)
            if check_hooks:
                self.check_pending()
        except pluggy.PluginValidationError as exc:
            if self.has_plugin(name):
                self.unregister(name=name)
            raise PluginError(f"plugin {name!r} ({origin}): {self._explain(exc)}") from exc
        except Exception:  # its nxdplug_add_hookspecs failed: nothing of it stays either
            if self.has_plugin(name):
                self.unregister(name=name)
            raise
        self._infos[name] = PluginInfo(
            name=name,
            distribution=distribution,
            version=version,
            status="active",
            module=getattr(plugin, "__name__", type(plugin).__name__),
            api_version=declared,
        )

    def _explain(self, exc: pluggy.PluginValidationError) -> str:
        """pluggy's validation message in plain words, with what the hook expects."""
        message = " ".join(str(exc).split())
        hooks = sorted(
            name
            for name in dir(self.hook)
            if name.startswith(f"{PROJECT_NAME}_") and getattr(self.hook, name).spec is not None
        )
        if message.startswith("unknown hook"):
            hook = message.split("'")[1]
            close = difflib.get_close_matches(hook, hooks, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"the hooks are: {', '.join(hooks)}"
            return f"hook implementation {hook!r} matches no nxdplug hook; {hint}"
        hook = next((h for h in hooks if f"'{h}'" in message), None)
        unknown = re.search(r"\{([^}]*)\} are declared in the hookimpl", message)
        if hook is not None and unknown is not None:
            expected = ", ".join(getattr(self.hook, hook).spec.argnames)
            return (
                f"its {hook} asks for {unknown.group(1)}, which the hook does not pass; the hook "
                f"passes ({expected}): use those names, or a subset of them"
            )
        return message

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
        self.refuse_unknown_hooks()

    def refuse_unknown_hooks(self) -> None:
        """Unregister, as failed, every plugin implementing a hook that no loaded plugin
        declares (a misspelled name, or a hook of a plugin that is not installed and not marked
        ``optionalhook``)."""
        while True:
            try:
                self.check_pending()
                return
            except pluggy.PluginValidationError as exc:
                name = self.get_name(exc.plugin)
                info = self._infos[name]
                message = f"plugin {name!r} ({info.origin}): {self._explain(exc)}"
                if self.strict:
                    raise PluginError(f"{message} ({STRICT_ENV} is set)") from exc
                warnings.warn(message, RuntimeWarning, stacklevel=2)
                self.unregister(name=name)
                self._infos[name] = attrs.evolve(info, status="failed", error=message)

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
                plugin,
                entry_point.name,
                distribution=distribution,
                version=version,
                check_hooks=False,
            )
        except Exception as exc:
            message = (
                str(exc)
                if isinstance(exc, PluginError)
                else f"plugin {entry_point.name!r} from {distribution} {version} "
                f"({entry_point.value}) failed to load: {type(exc).__name__}: {exc}"
            )
            if self.strict:
                raise PluginError(f"{message} ({STRICT_ENV} is set)") from exc
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            self._infos[entry_point.name] = PluginInfo(
                **base,
                status="failed",
                module=entry_point.value,
                error=str(exc) if isinstance(exc, PluginError) else f"{type(exc).__name__}: {exc}",
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
