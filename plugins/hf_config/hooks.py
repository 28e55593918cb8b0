"""Registers the reader of HF ``config.json`` as a config loader."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import ConfigLoader, hookimpl

NXDPLUG_API_VERSION = 2


@hookimpl
def nxdplug_config_loaders() -> Iterable[ConfigLoader]:
    yield ConfigLoader(
        name="hf-config-json",
        filenames=("config.json",),
        loader="nxdplug.plugins.hf_config.reader:read_hf_config",
        description="HF transformers config.json",
    )
