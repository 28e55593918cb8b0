"""examples/nxdplug-softcap, a third-party feature plugin, installed for real and used.

The package is built with pip into a folder of its own (``--target``), never into the shared
environment, and every check runs in a subprocess with that folder on ``PYTHONPATH``: nxdplug
finds the plugin only through its distribution's entry point, as it would for any user.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from tests import REPO_ROOT

PACKAGE = REPO_ROOT / "examples" / "nxdplug-softcap"
# Offline and into a folder of its own; the build uses the environment's setuptools.
PIP_INSTALL = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
PIP_INSTALL += ["--no-deps", "--no-build-isolation", "--no-index"]
CLI = [sys.executable, "-m", "nxdplug.cli.main"]


@attrs.frozen
class Installed:
    """The package built into ``site``; ``source`` is the copy it was built from."""

    site: Path
    source: Path

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(self.site), "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("softcap")
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources.
    ignore = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    source = shutil.copytree(PACKAGE, root / "source", ignore=ignore)
    site = root / "site"
    subprocess.run(
        [*PIP_INSTALL, "--target", str(site), str(source)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return Installed(site, source)


def nxdplug(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=120, env=env or dict(os.environ)
    )


def check_config(model_path: Path, cap: str, env: dict[str, str] | None = None) -> tuple:
    done = nxdplug(
        "check-config", "--model-path", str(model_path), "--json",
        "--neuron-config", f"final_logit_softcapping={cap}", env=env,
    )  # fmt: skip
    return done.returncode, json.loads(done.stdout)


def test_plugins_list_shows_the_package(installed) -> None:
    done = nxdplug("plugins", "list", "--json", env=installed.env())
    assert done.returncode == 0, done.stderr
    (row,) = [row for row in json.loads(done.stdout) if row["name"] == "softcap"]
    assert row["distribution"] == "nxdplug-softcap"
    assert row["version"] == "0.1.0"
    assert row["status"] == "active"
    assert row["provides"] == {"features": ["logit-softcap"]}


def test_check_config_selects_the_feature(installed, tiny_checkpoint) -> None:
    code, report = check_config(tiny_checkpoint("llama"), "30", installed.env())
    assert (code, report["problems"]) == (0, [])
    assert report["plugins"]["features"] == ["logit-softcap"]
    assert "softcap" in report["plugins"]["plugins"]


def test_check_config_reports_the_plugins_problem(installed, tiny_checkpoint) -> None:
    code, report = check_config(tiny_checkpoint("llama"), "-1", installed.env())
    assert code == 1
    (problem,) = report["problems"]
    assert problem.startswith("final_logit_softcapping=-1 is not a positive finite number")


def test_setting_is_unknown_without_the_package(tiny_checkpoint) -> None:
    code, report = check_config(tiny_checkpoint("llama"), "30")
    assert code == 1
    (problem,) = report["problems"]
    assert problem.startswith("unknown NeuronConfig attribute 'final_logit_softcapping'")


def test_run_generates_with_the_cap(installed, tiny_checkpoint) -> None:
    done = nxdplug(
        "run", "--model-path", str(tiny_checkpoint("llama")), "--prompt", "hello world",
        "--neuron-config", "final_logit_softcapping=5", "--torch-dtype", "float32",
        "--max-new-tokens", "8", "--check-accuracy-mode", "token-matching", "--quiet",
        env=installed.env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # capping is monotonic, so greedy tokens stay HF's
    assert "token matching: PASS" in done.stdout


def test_the_packages_own_tests_pass(installed) -> None:
    """Its tests, compiled path included, run from its own folder against the installed copy."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=installed.source,
        env=installed.env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
