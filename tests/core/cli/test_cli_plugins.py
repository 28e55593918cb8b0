"""The ``nxdplug`` command: error reporting, ``plugins list`` and the shared option helpers."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator

import pytest

from nxdplug.cli import plugins as cli_plugins
from nxdplug.cli.main import main
from nxdplug.cli.options import (
    add_neuron_config_options,
    add_sampling_options,
    neuron_config_kwargs,
    sampling_kwargs,
)
from nxdplug.errors import ConfigError
from nxdplug.manager import DENY_ENV, create_plugin_manager, use_plugin_manager
from nxdplug.registry import get_registry
from tests import REPO_ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PYPROJECT = REPO_ROOT / "pyproject.toml"


def builtin_plugin_names() -> list[str]:
    """The entry points this repository registers, read from pyproject.toml."""
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    return sorted(project["entry-points"]["nxdplug"])


@pytest.fixture
def fresh_manager() -> Iterator[None]:
    with use_plugin_manager(create_plugin_manager()):
        yield


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def list_plugins_json(capsys: pytest.CaptureFixture[str]) -> dict[str, dict]:
    code, out, _ = run_cli(capsys, "plugins", "list", "--json")
    assert code == 0
    rows = json.loads(out)
    assert [row["name"] for row in rows] == sorted(row["name"] for row in rows)
    return {row["name"]: row for row in rows}


def assert_one_error_paragraph(err: str) -> None:
    lines = [line for line in err.splitlines() if not line.startswith("nxdplug: warning:")]
    assert lines, "expected an error message on stderr"
    assert lines[0].startswith("nxdplug: error: ")
    assert "" not in lines, "the error must be one paragraph"
    assert "Traceback" not in err


# plugins list ---------------------------------------------------------------------------------


def test_plugins_list_json_shows_every_builtin_active(fresh_manager, capsys):
    rows = list_plugins_json(capsys)
    registry = get_registry()
    for name in builtin_plugin_names():
        row = rows[name]
        assert row["status"] == "active", row
        assert row["error"] is None
        assert row["distribution"] == "nxdplug"
        assert row["version"]
        assert row["provides"], f"{name} provides nothing"
        assert row["provides"] == registry.provided_by(name)
    architectures = {
        n for row in rows.values() for n in row["provides"].get("model_architectures", [])
    }
    assert {"dbrx", "gpt_oss", "llama", "mistral", "qwen2", "qwen3", "qwen3_moe"} <= architectures


def test_plugins_list_table_shows_every_builtin_and_what_it_provides(fresh_manager, capsys):
    code, out, _ = run_cli(capsys, "plugins", "list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["PLUGIN", "STATUS", "FROM", "PROVIDES"]
    registry = get_registry()
    for name in builtin_plugin_names():
        row = next(line for line in lines if line.split()[:1] == [name])
        assert row.split()[1] == "active"
        for kind, names in registry.provided_by(name).items():
            assert f"{kind}: {', '.join(names)}" in out
    assert re.fullmatch(r"\d+ plugins: \d+ active", lines[-1])


def test_failing_third_party_plugin_is_listed_as_failed(fake_distribution, capsys):
    fake_distribution(
        "fake_broken",
        "1.0",
        'raise RuntimeError("this plugin is broken on purpose")\n',
        entry_point="fake_broken",
    )
    with pytest.warns(RuntimeWarning, match="fake_broken"):
        manager = create_plugin_manager()
    with use_plugin_manager(manager):
        rows = list_plugins_json(capsys)
        code, table, _ = run_cli(capsys, "plugins", "list")

    broken = rows["fake_broken"]
    assert broken["status"] == "failed"
    assert (broken["distribution"], broken["version"]) == ("fake_broken", "1.0")
    assert "RuntimeError: this plugin is broken on purpose" in broken["error"]
    assert broken["provides"] == {}
    for name in builtin_plugin_names():
        assert rows[name]["status"] == "active"
    assert code == 0
    line = next(line for line in table.splitlines() if line.startswith("fake_broken"))
    assert "failed" in line
    assert "fake_broken 1.0" in line
    assert "this plugin is broken on purpose" in line


def test_denied_plugin_is_listed_as_disabled(monkeypatch, capsys):
    monkeypatch.setenv(DENY_ENV, "sampling")
    with use_plugin_manager(create_plugin_manager()):
        rows = list_plugins_json(capsys)
        _, table, _ = run_cli(capsys, "plugins", "list")
    assert rows["sampling"]["status"] == "disabled"
    assert rows["sampling"]["provides"] == {}
    assert all(rows[n]["status"] == "active" for n in builtin_plugin_names() if n != "sampling")
    assert next(line for line in table.splitlines() if line.startswith("sampling ")).split()[1] == (
        "disabled"
    )


def test_plugins_list_imports_no_torch_and_no_model_code():
    script = textwrap.dedent(
        """
        import contextlib, io, json, sys
        from nxdplug.cli.main import main
        with contextlib.redirect_stdout(io.StringIO()):
            code = main(["plugins", "list", "--json"])
        heavy = [m for m in ("torch", "transformers", "tokenizers") if m in sys.modules]
        model_code = [
            m for m in sys.modules
            if m.startswith("nxdplug.contrib_models.") and m.count(".") > 2
            and not m.endswith(".hooks")
        ]
        print(json.dumps({"code": code, "heavy": heavy, "model_code": model_code}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    result = json.loads(done.stdout.splitlines()[-1])
    assert result == {"code": 0, "heavy": [], "model_code": []}, done.stderr


# error reporting ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["no-such-command"],
        ["plugins"],
        ["make-tiny-model", "--architecture", "llama"],
        ["make-tiny-model", "--architecture", "llama", "--output", "x", "--set", "no-equals"],
    ],
)
def test_usage_errors_exit_2_with_one_paragraph(capsys, argv):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert out == ""
    assert_one_error_paragraph(err)
    assert "--help" in err


def test_help_exits_0(capsys):
    code, out, _ = run_cli(capsys, "make-tiny-model", "--help")
    assert code == 0
    assert "--architecture" in out


def test_user_error_has_no_traceback_unless_verbose(capsys, tmp_path):
    argv = ["make-tiny-model", "--architecture", "no-such-model", "--output", str(tmp_path / "m")]
    code, _, err = run_cli(capsys, *argv)
    assert code == 1
    assert_one_error_paragraph(err)
    assert "no-such-model" in err

    for verbose in (["-v", *argv], [*argv, "--verbose"]):
        code, _, err = run_cli(capsys, *verbose)
        assert code == 1
        assert "Traceback" in err
        assert err.rstrip().splitlines()[-1].startswith("nxdplug: error: ")


def test_unexpected_errors_keep_their_traceback(monkeypatch):
    def broken() -> list:
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli_plugins, "plugin_rows", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["plugins", "list"])


# shared option helpers ------------------------------------------------------------------------


def parse_with(add: Callable[[argparse.ArgumentParser], None], *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(list(argv))


def test_neuron_config_kwargs_holds_only_given_options():
    assert neuron_config_kwargs(parse_with(add_neuron_config_options)) == {}
    args = parse_with(
        add_neuron_config_options,
        *("--batch-size", "2", "--seq-len", "64", "--torch-dtype", "float32"),
        *("--enable-bucketing", "--context-encoding-buckets", "16", "32", "--no-fused-qkv"),
        *("--neuron-config", "kv_cache_quant=true", "--neuron-config", "note=hello"),
    )
    assert neuron_config_kwargs(args) == {
        "batch_size": 2,
        "seq_len": 64,
        "torch_dtype": "float32",
        "enable_bucketing": True,
        "context_encoding_buckets": [16, 32],
        "fused_qkv": False,
        "kv_cache_quant": True,
        "note": "hello",
    }


def test_neuron_config_option_given_twice_is_an_error():
    args = parse_with(
        add_neuron_config_options, "--batch-size", "2", "--neuron-config", "batch_size=4"
    )
    with pytest.raises(ConfigError, match="batch_size"):
        neuron_config_kwargs(args)


def test_neuron_config_options_validate_values():
    for argv in (["--torch-dtype", "float64"], ["--batch-size", "0"], ["--neuron-config", "x"]):
        with pytest.raises(SystemExit):
            parse_with(add_neuron_config_options, *argv)


def test_sampling_kwargs_holds_only_given_options():
    assert sampling_kwargs(parse_with(add_sampling_options)) == {}
    args = parse_with(
        add_sampling_options,
        *("--do-sample", "--top-k", "5", "--top-p", "0.9", "--temperature", "0.7"),
        *("--seed", "3", "--max-new-tokens", "8"),
    )
    assert sampling_kwargs(args) == {
        "do_sample": True,
        "top_k": 5,
        "top_p": 0.9,
        "temperature": 0.7,
        "seed": 3,
        "max_new_tokens": 8,
    }
