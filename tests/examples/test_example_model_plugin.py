"""A third-party model plugin installed for real: ``examples/nxdplug-gptneox``, built by pip.

The package goes into a private folder, never the shared environment; subprocesses put that
folder on PYTHONPATH, so nxdplug finds it only through its entry point. Deleting its files from
the folder is the uninstall.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from nxdplug.manager import ALLOW_ENV, DENY_ENV
from tests import REPO_ROOT

ROOT = REPO_ROOT
EXAMPLE = ROOT / "examples" / "nxdplug-gptneox"
NXDPLUG = Path(sys.executable).parent / "nxdplug"
PLUGIN = "gptneox"

FROM_PRETRAINED_AND_CHECK = """
import json, sys
import nxdplug
from nxdplug.testing import check_against_hf

model = nxdplug.from_pretrained(sys.argv[1], nxdplug.NeuronConfig(batch_size=2, seq_len=64))
report = check_against_hf(sys.argv[1], max_new_tokens=32)
print(json.dumps({
    "class": f"{type(model).__module__}:{type(model).__qualname__}",
    "file": sys.modules[type(model).__module__].__file__,
    "passed": report.passed,
    "summary": report.summary(),
    "tokens": report.expected.tolist(),
}))
"""

FROM_PRETRAINED = "import sys, nxdplug; nxdplug.from_pretrained(sys.argv[1])"


def run(args: list[str], site: Path) -> subprocess.CompletedProcess[str]:
    """``args`` in a fresh process that sees ``site`` as installed packages."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("PYTEST_") and key not in (ALLOW_ENV, DENY_ENV)
    }
    env.update(
        PYTHONPATH=str(site),
        PYTHONDONTWRITEBYTECODE="1",  # no __pycache__ left in the example's source tree
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return subprocess.run(
        [str(arg) for arg in args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )


def succeeded(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"{result.args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example installed by ``pip install --target``, from a copy of its folder (pip builds
    in the source tree, and ``build/`` does not belong in the repository)."""
    work = tmp_path_factory.mktemp("gptneox-install")
    source = work / "source"
    shutil.copytree(
        EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    target = work / "site"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation"]
    pip += ["--no-index", "--disable-pip-version-check", "--quiet", "--target", target, source]
    succeeded(run(pip, target))
    return target


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-NeoX checkpoint with partial rotary, saved by transformers."""
    folder = tmp_path_factory.mktemp("gpt_neox") / "checkpoint"
    config = GPTNeoXConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=512,
        rotary_pct=0.25,
        initializer_range=0.15,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = GPTNeoXForCausalLM(config)
    model.save_pretrained(folder)
    return folder


def listed_plugins(site: Path) -> dict[str, dict]:
    rows = json.loads(succeeded(run([NXDPLUG, "plugins", "list", "--json"], site)))
    return {row["name"]: row for row in rows}


def test_plugins_list_shows_the_installed_distribution(site: Path) -> None:
    row = listed_plugins(site)[PLUGIN]
    assert (row["distribution"], row["version"], row["status"]) == (
        "nxdplug-gptneox",
        "0.1.0",
        "active",
    )
    assert row["provides"] == {
        "model_architectures": ["gpt-neox"],
        "state_dict_converters": ["gpt-neox-hf"],
    }


def test_from_pretrained_picks_the_plugin_and_greedy_tokens_equal_hf(
    site: Path, checkpoint: Path
) -> None:
    result = json.loads(
        succeeded(run([sys.executable, "-c", FROM_PRETRAINED_AND_CHECK, checkpoint], site))
    )
    assert result["class"] == "nxdplug_gptneox.modeling:NeuronGPTNeoXForCausalLM"
    assert Path(result["file"]).is_relative_to(site)
    assert result["passed"], result["summary"]
    assert all(len(set(row)) >= 4 for row in result["tokens"])  # the greedy path varies


def test_the_package_own_tests_pass(site: Path) -> None:
    tests = EXAMPLE.relative_to(ROOT) / "tests"
    output = succeeded(run([sys.executable, "-m", "pytest", tests, "-q"], site))
    assert " passed" in output and "failed" not in output


def test_after_uninstalling_it_is_gone(site: Path, checkpoint: Path, tmp_path: Path) -> None:
    uninstalled = tmp_path / "site"
    shutil.copytree(site, uninstalled)
    for path in uninstalled.glob("nxdplug_gptneox*"):
        shutil.rmtree(path)

    assert PLUGIN not in listed_plugins(uninstalled)
    result = run([sys.executable, "-c", FROM_PRETRAINED, checkpoint], uninstalled)
    assert result.returncode != 0
    assert (
        "no installed model plugin serves architectures=['GPTNeoXForCausalLM'] "
        "model_type='gpt_neox'"
    ) in result.stderr
