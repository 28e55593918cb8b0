"""The plugin manager: entry points, tolerant and strict loading, allow- and deny-lists."""

from __future__ import annotations

import sys
import tomllib

import pytest

from nxdplug.errors import PluginError
from nxdplug.manager import create_plugin_manager
from nxdplug.registry import Registry
from nxdplug.testing import fresh_plugin_manager
from tests import REPO_ROOT

PYPROJECT = REPO_ROOT / "pyproject.toml"

SAMPLER_PLUGIN = """
    from nxdplug import hookimpl
    from nxdplug.types import Sampler

    @hookimpl
    def nxdplug_samplers():
        yield Sampler(name="third-party-top1", implementation="third_party.mod:Top1")
"""


def builtin_plugin_names() -> set[str]:
    data = tomllib.loads(PYPROJECT.read_text())
    return set(data["project"]["entry-points"]["nxdplug"])


def test_every_builtin_registers_through_the_entry_point_group() -> None:
    manager = create_plugin_manager()
    infos = {info.name: info for info in manager.plugin_infos()}
    assert builtin_plugin_names() <= set(infos)
    for name in builtin_plugin_names():
        assert infos[name].status == "active", infos[name]
        assert infos[name].distribution == "nxdplug"
        assert manager.has_plugin(name)


def test_third_party_distribution_is_loaded_like_a_builtin(fake_distribution) -> None:
    fake_distribution("acme", "1.2.3", SAMPLER_PLUGIN)
    manager = create_plugin_manager()
    info = manager.plugin_info("acme")
    assert (info.status, info.distribution, info.version) == ("active", "acme", "1.2.3")
    registry = Registry(manager)
    assert registry.provider("samplers", "third-party-top1") == "acme"
    assert registry.provider("samplers", "greedy") == "sampling"


def test_broken_plugin_is_reported_and_the_rest_keeps_working(fake_distribution) -> None:
    fake_distribution("brokenpkg", "0.9", "raise ImportError('needs libfoo')\n")
    with pytest.warns(RuntimeWarning, match="brokenpkg 0.9"):
        manager = create_plugin_manager(strict=False)
    info = manager.plugin_info("brokenpkg")
    assert info.status == "failed"
    assert "needs libfoo" in info.error
    assert Registry(manager).names("samplers") == ["greedy", "multinomial"]


def test_strict_mode_makes_a_broken_plugin_fatal(fake_distribution, monkeypatch) -> None:
    fake_distribution("brokenpkg", "0.9", "raise ImportError('needs libfoo')\n")
    monkeypatch.setenv("NXDPLUG_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match=r"brokenpkg 0\.9.*needs libfoo"):
        create_plugin_manager()


def test_deny_list_disables_a_plugin(monkeypatch) -> None:
    monkeypatch.setenv("NXDPLUG_DENY_PLUGINS", "sampling, fused_qkv")
    manager = create_plugin_manager()
    assert manager.plugin_info("sampling").status == "disabled"
    assert manager.plugin_info("fused_qkv").status == "disabled"
    assert not manager.has_plugin("sampling")
    assert manager.plugin_info("llama").status == "active"


def test_allow_list_keeps_only_the_named_plugins(monkeypatch) -> None:
    monkeypatch.setenv("NXDPLUG_ALLOW_PLUGINS", "llama,sampling")
    manager = create_plugin_manager()
    active = {i.name for i in manager.plugin_infos() if i.status == "active"}
    assert active == {"llama", "sampling"}


def test_registering_a_name_twice_is_refused() -> None:
    manager = create_plugin_manager()
    with pytest.raises(PluginError, match="already registered"):
        manager.register_plugin(object(), "llama")


def test_fresh_plugin_manager_restores_the_previous_one() -> None:
    from nxdplug.manager import get_plugin_manager

    before = get_plugin_manager()
    with fresh_plugin_manager(load_entrypoints=False) as manager:
        assert get_plugin_manager() is manager
        assert manager.plugin_infos() == []
    assert get_plugin_manager() is before


def test_listing_plugins_imports_no_model_code() -> None:
    import subprocess

    code = (
        "import sys\n"
        "from nxdplug.registry import get_registry\n"
        "r = get_registry()\n"
        "for kind in ('model_architectures', 'samplers', 'features'): r.records(kind)\n"
        "heavy = [m for m in sys.modules if m == 'torch' or m.endswith('modeling_llama')]\n"
        "print(heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
