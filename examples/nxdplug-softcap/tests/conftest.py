"""Fixtures: offline HF, one tiny Llama checkpoint, and this plugin registered.

The tests run against the installed package when there is one (its entry point registers the
plugin), and against ``src/`` registered in-process otherwise.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:
    import nxdplug_softcap  # noqa: F401 (installed)
except ImportError:  # a source checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from nxdplug.testing.tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama") / "checkpoint")


@pytest.fixture
def softcap_plugin() -> Iterator[Any]:
    """A fresh process-wide plugin manager that holds this plugin, installed or not."""
    from nxdplug.testing import fresh_plugin_manager, temporary_plugin

    from nxdplug_softcap import hooks

    with fresh_plugin_manager() as manager:
        if manager.is_registered(hooks):
            yield manager
        else:
            with temporary_plugin(hooks, "softcap", manager):
                yield manager
