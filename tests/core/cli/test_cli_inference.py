"""`nxdplug check-config` and `nxdplug run`: results, exit codes, and one-paragraph errors."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from nxdplug.cli.main import main


@pytest.fixture(scope="module")
def llama_path(tiny_checkpoint):
    return tiny_checkpoint("llama")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_check_config_lists_the_plugin_set(capsys, llama_path) -> None:
    code, out, _ = run_cli(
        capsys, "check-config", "--model-path", str(llama_path), "--fused-qkv", "--json"
    )
    assert code == 0
    report = json.loads(out)
    assert report["problems"] == []
    assert report["plugins"]["model"] == "llama"
    assert report["plugins"]["features"] == ["fused-qkv"]
    assert report["plugins"]["state_dict_converters"][-1] == "fused-qkv"


def test_check_config_reports_every_problem_and_exits_1(capsys, llama_path) -> None:
    code, out, err = run_cli(
        capsys,
        "check-config",
        "--model-path",
        str(llama_path),
        "--neuron-config",
        "batch_size=0",
        "--neuron-config",
        "fused_qvk=true",
        "--neuron-config",
        "flash_decoding_enabled=true",
    )
    assert code == 1 and err == ""
    assert "3 problem(s)" in out
    assert "batch_size is 0" in out
    assert "did you mean 'fused_qkv'" in out
    assert "flash_decoding_enabled splits each K/V head's cache over the ranks" in out


@pytest.mark.parametrize("mode", ["token-matching", "logit-matching"])
def test_run_generates_and_matches_hf(capsys, llama_path, mode) -> None:
    code, out, _ = run_cli(
        capsys,
        "run",
        "--model-path",
        str(llama_path),
        "--prompt",
        "def f(x):",
        "--prompt",
        "import sys",
        "--max-new-tokens",
        "16",
        "--torch-dtype",
        "float32",
        "--check-accuracy-mode",
        mode,
    )
    assert code == 0, out
    assert "Output 0: def f(x):" in out and "Output 1: import sys" in out
    assert f"{mode.replace('-', ' ')}: PASS" in out


def test_run_samples_reproducibly_with_a_seed(capsys, llama_path) -> None:
    argv = ["run", "--model-path", str(llama_path), "--prompt", "x = ", "--do-sample"]
    argv += ["--temperature", "2.0", "--seed", "7", "--max-new-tokens", "12"]
    first = run_cli(capsys, *argv)[1].split("\n\n")[0]
    second = run_cli(capsys, *argv)[1].split("\n\n")[0]
    assert first == second


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model-path", "/no/such/folder"], "is not a folder"),
        (["--max-new-tokens", "500"], "seq_len=128"),
        (["--neuron-config", "batch_size=0"], "batch_size is 0"),
        (["--max-context-length", "2"], "largest context_encoding_model bucket is 2"),
    ],
)
def test_run_user_errors_are_one_message_without_traceback(
    capsys, llama_path, argv, message
) -> None:
    base = ["run", "--model-path", str(llama_path), "--prompt", "def f(x):"]
    code, _, err = run_cli(capsys, *base, *argv)
    assert code == 1
    assert err.startswith("nxdplug: error: ")
    assert message in err
    assert "Traceback" not in err


def test_mis_shaped_checkpoint_names_the_tensor(capsys, llama_path, tmp_path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(llama_path, broken)
    weights = load_file(broken / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"][:5]
    del weights["model.norm.weight"]
    save_file(weights, broken / "model.safetensors")
    code, _, err = run_cli(capsys, "run", "--model-path", str(broken), "--prompt", "x")
    assert code == 1 and "Traceback" not in err
    assert "layers.1.mlp.up_proj.weight: expected [128, 64], found [5, 64]" in err
    assert "missing norm.weight" in err
