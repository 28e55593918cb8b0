"""Tiny random checkpoints and the offline tokenizer: what tests and examples stand on."""

from __future__ import annotations

import inspect
import json
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nxdplug.cli.main import main
from nxdplug.errors import ConfigError, PluginError, UnknownNameError
from nxdplug.hookspecs import hookimpl
from nxdplug.manager import create_plugin_manager, use_plugin_manager
from nxdplug.registry import get_registry
from nxdplug.testing import tiny_models
from nxdplug.testing.tiny_models import make_tiny_checkpoint, tiny_config_defaults
from nxdplug.testing.tokenizer_builder import END_OF_TEXT, MIN_VOCAB_SIZE, build_tokenizer
from nxdplug.types import ModelArchitecture

ARCHITECTURES = [
    record.name
    for record in get_registry().records("model_architectures")
    if record.hf_model_class is not None
]

PYTHON_SAMPLES = [
    inspect.getsource(textwrap.dedent),
    "def fibonacci(n):\n\tif n < 2:\n\t\treturn n  # base case\n\n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)   \n",
    "import os\nprint(f'{os.sep!r} {{}} [1, 2, 3] == (4,) ; ~x ^ y @ z')",
    "",
]


def assert_one_error_paragraph(err: str) -> None:
    lines = [line for line in err.splitlines() if not line.startswith("nxdplug: warning:")]
    assert lines
    assert lines[0].startswith("nxdplug: error: ")
    assert "" not in lines
    assert "Traceback" not in err


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


# tokenizer ------------------------------------------------------------------------------------


def test_tokenizer_round_trips_python_source(tmp_path):
    build_tokenizer(tmp_path, 512)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert len(tokenizer) == 512
    assert tokenizer.convert_ids_to_tokens(0) == END_OF_TEXT
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 0, 0)
    for text in PYTHON_SAMPLES:
        ids = tokenizer(text)["input_ids"]
        assert 0 not in ids, "encoding must add no special token"
        assert tokenizer.decode(ids) == text
    source = PYTHON_SAMPLES[0]
    assert len(tokenizer(source)["input_ids"]) < len(source) / 2, "BPE merges should compress code"


def test_tokenizer_is_deterministic_and_fast(tmp_path):
    started = time.perf_counter()
    build_tokenizer(tmp_path / "a", 2048)
    assert time.perf_counter() - started < 2.0
    build_tokenizer(tmp_path / "b", 2048)
    assert folder_bytes(tmp_path / "a") == folder_bytes(tmp_path / "b")
    assert sorted(folder_bytes(tmp_path / "a")) == ["tokenizer.json", "tokenizer_config.json"]


def test_tokenizer_refuses_a_vocabulary_smaller_than_the_bytes(tmp_path):
    with pytest.raises(ConfigError, match=f">= {MIN_VOCAB_SIZE}"):
        build_tokenizer(tmp_path, 256)


# tiny checkpoints -----------------------------------------------------------------------------


def test_the_builtin_architectures_are_buildable():
    builtin = {"dbrx", "gpt_oss", "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe"}
    assert builtin <= set(ARCHITECTURES)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_make_tiny_model_loads_offline_with_transformers(architecture, tmp_path, capsys):
    output = tmp_path / architecture
    code = main(["make-tiny-model", "--architecture", architecture, "--output", str(output)])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out[0] == str(output)
    assert "2 layers" in out[1]
    assert "4 attention heads" in out[1]
    assert "parameters" in out[1]

    model = AutoModelForCausalLM.from_pretrained(output, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(output, local_files_only=True)
    record = get_registry().get("model_architectures", architecture)
    assert type(model) is record.load("hf_model_class")
    assert model.dtype == torch.float32
    declared = set(model.config.to_dict()) | set(model.config.attribute_map)
    for key, value in tiny_config_defaults().items():
        if key in declared:
            assert getattr(model.config, key) == value, key
    assert model.generation_config.do_sample is False
    assert model.generation_config.eos_token_id == 0

    prompt = tokenizer("def fibonacci(n):", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    new_tokens = generated[0, prompt["input_ids"].shape[1] :].tolist()
    assert len(set(new_tokens)) > 2, f"greedy decoding should not repeat one token: {new_tokens}"


def test_same_seed_gives_the_same_bytes(tmp_path):
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    first = folder_bytes(make_tiny_checkpoint("llama", tmp_path / "first", seed=7))
    assert torch.equal(torch.rand(3), expected), "the caller's random state must be left alone"
    second = folder_bytes(make_tiny_checkpoint("llama", tmp_path / "second", seed=7))
    other = folder_bytes(make_tiny_checkpoint("llama", tmp_path / "other", seed=8))
    assert first == second
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]


def test_overrides_change_the_config(tmp_path):
    defaults = tiny_config_defaults()
    defaults["hidden_size"] = 1  # a copy: changing it changes nothing
    path = make_tiny_checkpoint(
        "qwen2", tmp_path / "m", overrides={"num_hidden_layers": 3, "rope_theta": 500.0}
    )
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 3
    assert config["hidden_size"] == 64
    # transformers 5 moves rope_theta into rope_parameters; 4.x keeps it at the top level.
    assert config.get("rope_parameters", config)["rope_theta"] == 500.0


def test_a_non_empty_folder_is_refused_without_force(tmp_path, capsys):
    output = tmp_path / "model"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    argv = ["make-tiny-model", "--architecture", "llama", "--output", str(output)]

    assert main(argv) == 1
    err = capsys.readouterr().err
    assert_one_error_paragraph(err)
    assert "not empty" in err
    assert "--force" in err
    assert folder_bytes(output) == {"keep.txt": b"mine"}
    assert [p.name for p in tmp_path.iterdir()] == ["model"]

    assert main([*argv, "--force"]) == 0
    assert "keep.txt" not in folder_bytes(output)
    assert (output / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["model"], "no staging folder is left behind"


def test_an_empty_existing_folder_is_used(tmp_path):
    (tmp_path / "model").mkdir()
    path = make_tiny_checkpoint("mistral", tmp_path / "model")
    assert (path / "config.json").is_file()


def test_an_interrupted_build_leaves_no_half_folder(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny_models, "_save_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        make_tiny_checkpoint("llama", tmp_path / "new")
    assert list(tmp_path.iterdir()) == []

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(KeyboardInterrupt):
        make_tiny_checkpoint("llama", existing, force=True)
    assert folder_bytes(existing) == {"keep.txt": b"mine"}
    assert [p.name for p in tmp_path.iterdir()] == ["existing"]


def test_unknown_architecture_lists_the_choices(tmp_path, capsys):
    argv = ["make-tiny-model", "--architecture", "lama", "--output", str(tmp_path / "m")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert_one_error_paragraph(err)
    assert "'lama'" in err
    for name in ARCHITECTURES:
        assert repr(name) in err
    assert not (tmp_path / "m").exists()
    with pytest.raises(UnknownNameError):
        make_tiny_checkpoint("lama", tmp_path / "m")


def test_bad_set_key_is_named(tmp_path, capsys):
    argv = ["make-tiny-model", "--architecture", "llama", "--output", str(tmp_path / "m")]
    assert main([*argv, "--set", "hiden_size=128", "--set", "num_hidden_layers=1"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("nxdplug: error: ")
    assert "'hiden_size' (did you mean 'hidden_size'?)" in err
    assert "num_hidden_layers" in err  # listed among the valid attributes
    assert list(tmp_path.iterdir()) == []


def test_bad_set_value_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="hidden_size"):
        make_tiny_checkpoint("llama", tmp_path / "m", overrides={"hidden_size": "wide"})
    with pytest.raises(ConfigError, match="cannot be overridden"):
        make_tiny_checkpoint("llama", tmp_path / "m", overrides={"model_type": "mistral"})


def test_an_architecture_without_transformers_classes_is_explained(tmp_path):
    class NoHFClasses:
        @hookimpl
        def nxdplug_model_architectures(self):
            yield ModelArchitecture(
                name="bare",
                model_type="bare",
                application="pkg.modeling:App",
                config_class="pkg.modeling:Config",
            )

    manager = create_plugin_manager(load_entrypoints=False)
    manager.register_plugin(NoHFClasses(), "bare")
    with use_plugin_manager(manager), pytest.raises(PluginError, match="hf_model_class"):
        make_tiny_checkpoint("bare", tmp_path / "m")
