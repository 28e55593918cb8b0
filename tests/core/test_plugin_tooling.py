"""Broken third-party plugins, the plugin API version, `plugins list --hook`, `plugins doctor`
and the generated hook reference."""

from __future__ import annotations

import json

import pytest

from nxdplug.cli.main import main
from nxdplug.cli.plugins import hook_names, hook_reference_markdown
from nxdplug.errors import PluginError
from nxdplug.hookspecs import API_VERSION
from nxdplug.manager import create_plugin_manager
from nxdplug.registry import Registry
from nxdplug.testing import fresh_plugin_manager
from tests import REPO_ROOT

DOCS = REPO_ROOT / "docs"

MISSPELLED_HOOK = """
    from nxdplug import hookimpl
    from nxdplug.types import Sampler

    NXDPLUG_API_VERSION = 2

    @hookimpl
    def nxdplug_samplrs():
        yield Sampler(name="typo", implementation="x.y:Z")
"""

WRONG_SIGNATURE = """
    from nxdplug import hookimpl

    NXDPLUG_API_VERSION = 2

    @hookimpl
    def nxdplug_add_hookspecs(manager):
        pass
"""

FUTURE_API = """
    NXDPLUG_API_VERSION = 3
"""

TAKEN_NAME = """
    from nxdplug import hookimpl
    from nxdplug.types import Sampler

    NXDPLUG_API_VERSION = 2

    @hookimpl
    def nxdplug_samplers():
        yield Sampler(name="greedy", implementation="collections:OrderedDict")
"""

BAD_REFERENCE = """
    from nxdplug import hookimpl
    from nxdplug.types import Sampler

    @hookimpl
    def nxdplug_samplers():
        yield Sampler(name="ghost", implementation="no_such_module_anywhere:Sampler")
"""

CASES = {
    "misspelled-hook": (
        MISSPELLED_HOOK,
        "hook implementation 'nxdplug_samplrs' matches no nxdplug hook; "
        "did you mean 'nxdplug_samplers'?",
    ),
    "wrong-signature": (
        WRONG_SIGNATURE,
        "asks for 'manager', which the hook does not pass; the hook passes (pluginmanager)",
    ),
    "future-api": (FUTURE_API, "written for nxdplug plugin API 3, but this nxdplug provides API 2"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_plugin_is_reported_and_the_rest_keeps_working(fake_distribution, case) -> None:
    source, expected = CASES[case]
    fake_distribution("acme", "2.0", source)
    with pytest.warns(RuntimeWarning, match="acme 2.0"):
        manager = create_plugin_manager(strict=False)
    info = manager.plugin_info("acme")
    assert info.status == "failed"
    assert expected in info.error and "acme 2.0" in info.error
    assert not manager.has_plugin("acme")
    registry = Registry(manager)
    assert registry.names("samplers") == ["greedy", "multinomial"]
    assert registry.get("model_architectures", "llama")


@pytest.mark.parametrize("case", sorted(CASES))
def test_strict_mode_makes_each_broken_case_fatal(fake_distribution, monkeypatch, case) -> None:
    source, expected = CASES[case]
    fake_distribution("acme", "2.0", source)
    monkeypatch.setenv("NXDPLUG_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match=r"acme 2\.0") as error:
        create_plugin_manager()
    assert expected in str(error.value)


def test_a_taken_name_is_a_conflict_naming_both_distributions(fake_distribution, capsys) -> None:
    fake_distribution("acme", "2.0", TAKEN_NAME)
    with fresh_plugin_manager() as manager:
        registry = Registry(manager)
        with pytest.raises(PluginError) as error:
            registry.get("samplers", "greedy")
        message = str(error.value)
        assert "'sampling' (nxdplug 0.1.0)" in message and "'acme' (acme 2.0)" in message
        assert registry.get("model_architectures", "llama")  # other kinds keep working
        assert main(["plugins", "doctor"]) == 1
    out = capsys.readouterr().out
    assert "problem: conflicting sampler names" in out


def test_doctor_finds_references_that_do_not_import(fake_distribution, capsys) -> None:
    fake_distribution("ghosts", "0.1", BAD_REFERENCE)
    with fresh_plugin_manager():
        assert main(["plugins", "doctor", "--json"]) == 1
    findings = json.loads(capsys.readouterr().out)
    (problem,) = findings["problems"]
    assert problem.startswith("ghosts: samplers 'ghost', field implementation")
    assert "no_such_module_anywhere" in problem
    assert any("ghosts (ghosts 0.1) does not declare" in w for w in findings["warnings"])


def test_doctor_passes_on_the_builtins(capsys) -> None:
    with fresh_plugin_manager():
        assert main(["plugins", "doctor"]) == 0
    assert "no problems, 0 warning(s)" in capsys.readouterr().out


def test_every_builtin_declares_the_api_version() -> None:
    manager = create_plugin_manager()
    declared = {i.api_version for i in manager.plugin_infos() if i.distribution == "nxdplug"}
    assert declared == {API_VERSION}


def test_plugins_list_by_hook(capsys) -> None:
    assert main(["plugins", "list", "--hook", "nxdplug_samplers", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["name"] for row in rows] == ["sampling"]
    assert rows[0]["hooks"] == [
        "nxdplug_cli_extensions",
        "nxdplug_features",
        "nxdplug_samplers",
        "nxdplug_step_inputs",
    ]
    assert main(["plugins", "list", "--hook", "nxdplug_samplrs"]) == 1
    assert "'nxdplug_samplrs' is not a hook" in capsys.readouterr().err


def test_hook_reference_is_generated_and_up_to_date(capsys) -> None:
    generated = hook_reference_markdown()
    assert (DOCS / "hooks.md").read_text() == generated, (
        "run: nxdplug plugins hooks > docs/hooks.md"
    )
    for name in hook_names():
        section = generated.split(f"### `{name}(")[1].split("\n### ")[0]
        assert (
            "```python" in section and f"def {name}(" in section and "@nxdplug.hookimpl" in section
        )
    assert main(["plugins", "hooks"]) == 0
    assert capsys.readouterr().out == generated
