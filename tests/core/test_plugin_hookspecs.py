"""Plugins that add hooks and commands: the serve plugin's kind of extension, open to anyone."""

from __future__ import annotations

import pytest

from nxdplug.cli.main import main
from nxdplug.manager import create_plugin_manager
from nxdplug.registry import Registry
from nxdplug.testing import fresh_plugin_manager

# Loaded after the plugin below that implements its hook (entry points load in name order).
HOST_PLUGIN = """
    from nxdplug import hookimpl
    from nxdplug.hookspecs import hookspec
    from nxdplug.types import PluginRecord, RecordKind, Subcommand

    class Greeting(PluginRecord):
        pass

    class GreetingSpecs:
        @hookspec
        def nxdplug_greetings(self):
            '''Register greetings.'''

    @hookimpl
    def nxdplug_add_hookspecs(pluginmanager):
        pluginmanager.add_plugin_hookspecs(
            GreetingSpecs, RecordKind("greetings", "nxdplug_greetings", Greeting, "greeting")
        )

    @hookimpl
    def nxdplug_commands():
        yield Subcommand(
            name="greet",
            description="print the registered greetings",
            add_arguments="zzz_host_plugin:add_arguments",
            run="zzz_host_plugin:run",
        )

    def add_arguments(parser):
        parser.add_argument("--shout", action="store_true")

    def run(args):
        from nxdplug.registry import get_registry

        names = get_registry().names("greetings")
        print(" ".join(n.upper() if args.shout else n for n in names))
        return 3
"""

GUEST_PLUGIN = """
    from nxdplug import hookimpl
    from zzz_host_plugin import Greeting

    @hookimpl
    def nxdplug_greetings():
        yield Greeting(name="hello")
"""

OPTIONAL_GUEST_PLUGIN = """
    from nxdplug import hookimpl

    @hookimpl(optionalhook=True)
    def nxdplug_farewells():
        yield "bye"
"""

MISSPELLED_PLUGIN = """
    from nxdplug import hookimpl

    @hookimpl
    def nxdplug_sampler():
        return []
"""

SECOND_HOST_PLUGIN = """
    from nxdplug import hookimpl
    from nxdplug.hookspecs import hookspec
    from nxdplug.types import PluginRecord, RecordKind

    class Specs:
        @hookspec
        def nxdplug_salutations(self):
            '''Register salutations.'''

    @hookimpl
    def nxdplug_add_hookspecs(pluginmanager):
        pluginmanager.add_plugin_hookspecs(
            Specs, RecordKind("greetings", "nxdplug_greetings", PluginRecord, "greeting")
        )
"""

CLASHING_COMMAND_PLUGIN = """
    from nxdplug import hookimpl
    from nxdplug.types import Subcommand

    @hookimpl
    def nxdplug_commands():
        yield Subcommand(name="run", add_arguments="builtins:print", run="builtins:print")
"""


def test_a_plugin_implements_a_hook_that_a_plugin_loaded_after_it_adds(fake_distribution):
    fake_distribution("zzz_host", "1.0", HOST_PLUGIN)
    fake_distribution("aaa_guest", "1.0", GUEST_PLUGIN)
    manager = create_plugin_manager(strict=True)
    assert manager.plugin_info("aaa_guest").status == "active"
    assert "greetings" in manager.record_kinds
    registry = Registry(manager)
    assert registry.names("greetings") == ["hello"]
    assert registry.provider("greetings", "hello") == "aaa_guest"
    assert any(cls.__name__ == "GreetingSpecs" for cls in manager.spec_classes)


def test_a_record_kind_declared_twice_fails_the_second_declarer(fake_distribution):
    fake_distribution("zzz_host", "1.0", HOST_PLUGIN)
    fake_distribution("zzzz_second", "1.0", SECOND_HOST_PLUGIN)
    with pytest.warns(RuntimeWarning, match="'greetings' is declared twice"):
        manager = create_plugin_manager(strict=False)
    assert manager.plugin_info("zzzz_second").status == "failed"
    assert not manager.has_plugin("zzzz_second")
    assert manager.plugin_info("zzz_host").status == "active"
    assert not hasattr(manager.hook, "nxdplug_salutations")


def test_a_hook_nobody_declares_fails_its_plugin_alone(fake_distribution):
    fake_distribution("typo", "0.1", MISSPELLED_PLUGIN)
    fake_distribution("optional_guest", "0.1", OPTIONAL_GUEST_PLUGIN)
    with pytest.warns(RuntimeWarning, match="nxdplug_sampler.*did you mean 'nxdplug_samplers'"):
        manager = create_plugin_manager(strict=False)
    failed = manager.plugin_info("typo")
    assert failed.status == "failed" and "matches no nxdplug hook" in failed.error
    assert not manager.has_plugin("typo")
    assert manager.plugin_info("optional_guest").status == "active"
    assert Registry(manager).names("samplers") == ["greedy", "multinomial"]


def test_strict_mode_makes_an_undeclared_hook_fatal(fake_distribution):
    fake_distribution("typo", "0.1", MISSPELLED_PLUGIN)
    with pytest.raises(Exception, match="nxdplug_sampler"):
        create_plugin_manager(strict=True)


def test_a_plugin_command_is_parsed_and_run_by_nxdplug(fake_distribution, capsys):
    fake_distribution("zzz_host", "1.0", HOST_PLUGIN)
    fake_distribution("aaa_guest", "1.0", GUEST_PLUGIN)
    with fresh_plugin_manager():
        assert main(["greet", "--shout"]) == 3
        assert capsys.readouterr().out.strip() == "HELLO"
        assert main(["--help"]) == 0
        assert "print the registered greetings" in capsys.readouterr().out


def test_a_plugin_command_may_not_take_a_core_commands_name(fake_distribution, capsys):
    fake_distribution("clash", "1.0", CLASHING_COMMAND_PLUGIN)
    with fresh_plugin_manager():
        assert main(["run", "--help"]) == 1
    assert "plugin 'clash' registers the command 'run'" in capsys.readouterr().err


def test_without_the_serve_plugin_its_guests_still_load(monkeypatch, capsys):
    monkeypatch.setenv("NXDPLUG_DENY_PLUGINS", "serve")
    with fresh_plugin_manager() as manager:
        for guest in ("lora", "tool_calling", "reasoning"):
            assert manager.plugin_info(guest).status == "active", guest
        assert "serving_routes" not in manager.record_kinds
        assert Registry(manager).names("features")  # the rest of the registry works
        assert main(["serve", "--model-path", "x"]) == 2
    error = capsys.readouterr().err
    assert "invalid choice: 'serve'" in error and "disabled by" in error and "serve" in error
