"""Plugin isolation for tests: a fresh plugin manager, a plugin registered for one block."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from nxdplug.plugin_api import (
    NxdPlugPluginManager,
    create_plugin_manager,
    get_plugin_manager,
    use_plugin_manager,
)


@contextmanager
def fresh_plugin_manager(
    *, load_entrypoints: bool = True, **options: Any
) -> Iterator[NxdPlugPluginManager]:
    """A new process-wide plugin manager inside the block; the previous one comes back after."""
    manager = create_plugin_manager(load_entrypoints=load_entrypoints, **options)
    with use_plugin_manager(manager):
        yield manager


@contextmanager
def temporary_plugin(
    plugin: Any, name: str, manager: NxdPlugPluginManager | None = None
) -> Iterator[Any]:
    """Register ``plugin`` under ``name`` for the block; always unregistered afterwards."""
    manager = manager or get_plugin_manager()
    manager.register_plugin(plugin, name)
    try:
        yield plugin
    finally:
        manager.unregister_plugin(name)
