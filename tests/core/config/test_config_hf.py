"""load_pretrained_config and the hf_config plugin, on tiny configs written by transformers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from nxdplug.config import (
    InferenceConfig,
    NeuronConfig,
    load_pretrained_config,
    read_model_attributes,
    with_rope_aliases,
)
from nxdplug.config.neuron_config import LNC_ENV
from nxdplug.errors import ConfigError
from nxdplug.hookspecs import hookimpl
from nxdplug.manager import NxdPlugPluginManager, create_plugin_manager, use_plugin_manager
from nxdplug.plugins.hf_config.reader import read_hf_config
from nxdplug.registry import get_registry
from nxdplug.types import ConfigLoader

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama3_rope() -> dict[str, Any]:
    """A fresh copy: transformers adds rope_theta to the dict it is given."""
    return dict(LLAMA3_ROPE)


@pytest.fixture(autouse=True)
def manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[NxdPlugPluginManager]:
    """A plugin manager holding only the hf_config plugin, loaded through its entry point."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(LNC_ENV, raising=False)
    fresh = create_plugin_manager(allow=frozenset({"hf_config"}), deny=frozenset())
    with use_plugin_manager(fresh):
        yield fresh


def load(model_path: Path, **neuron: Any) -> InferenceConfig:
    return InferenceConfig(NeuronConfig(**neuron), load_config=load_pretrained_config(model_path))


def test_the_builtin_loader_is_registered() -> None:
    (record,) = get_registry().records("config_loaders")
    assert record.name == "hf-config-json"
    assert record.filenames == ("config.json",)
    assert record.load("loader") is read_hf_config


def test_llama(tmp_path: Path) -> None:
    LlamaConfig(**TINY, tie_word_embeddings=True, pad_token_id=0).save_pretrained(tmp_path)
    config = load(tmp_path)
    assert config.model_type == "llama"
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (
        64,
        4,
        2,
    )
    assert config.head_dim == 16
    assert config.tie_word_embeddings is True
    assert (config.pad_token_id, config.eos_token_id) == (0, 2)
    assert config.rope_parameters == {"rope_theta": 10000.0, "rope_type": "default"}
    assert (config.rope_theta, config.rope_scaling) == (10000.0, None)
    assert config._name_or_path == str(tmp_path)
    assert config.transformers_version


def test_mistral_keeps_sliding_window(tmp_path: Path) -> None:
    MistralConfig(**TINY, sliding_window=32, head_dim=8).save_pretrained(tmp_path)
    config = load(tmp_path)
    assert (config.model_type, config.sliding_window, config.head_dim) == ("mistral", 32, 8)
    assert config.rope_theta == 10000.0


def test_qwen2(tmp_path: Path) -> None:
    Qwen2Config(**TINY, rope_theta=1_000_000.0).save_pretrained(tmp_path)
    config = load(tmp_path)
    assert config.model_type == "qwen2"
    assert config.rope_theta == 1_000_000.0
    assert config.sliding_window is None
    assert config.tie_word_embeddings is False


def test_transformers5_rope_parameters_with_llama3_scaling(tmp_path: Path) -> None:
    hf = LlamaConfig(
        **TINY, max_position_embeddings=16384, rope_scaling=llama3_rope(), rope_theta=500000.0
    )
    hf.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in written and "rope_theta" not in written  # transformers 5 form
    config = load(tmp_path)
    assert config.rope_parameters == {**LLAMA3_ROPE, "rope_theta": 500000.0}
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == LLAMA3_ROPE


def test_transformers4_rope_keys_get_rope_parameters_too(tmp_path: Path) -> None:
    raw = {"model_type": "llama", **TINY, "max_position_embeddings": 16384}
    raw |= {"rope_theta": 500000.0, "rope_scaling": llama3_rope(), "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load(tmp_path)
    assert config.rope_scaling == LLAMA3_ROPE
    assert config.rope_theta == 500000.0
    assert config.rope_parameters["rope_type"] == "llama3"


def test_both_rope_forms_in_one_file(tmp_path: Path) -> None:
    """As in the shared pycoder-tiny checkpoint: rope_parameters plus rope_theta / rope_scaling."""
    raw = {"model_type": "llama", **TINY, "dtype": "float32", "torch_dtype": "float32"}
    raw |= {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
    raw |= {"rope_theta": 10000.0, "rope_scaling": None}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load(tmp_path)
    assert (config.rope_theta, config.rope_scaling) == (10000.0, None)
    assert not hasattr(config, "dtype") and not hasattr(config, "torch_dtype")


def test_checkpoint_dtype_applies_unless_the_user_chose_one(tmp_path: Path) -> None:
    LlamaConfig(**TINY, dtype="float32").save_pretrained(tmp_path)
    assert load(tmp_path).neuron_config.torch_dtype is torch.float32
    assert load(tmp_path, torch_dtype="bfloat16").neuron_config.torch_dtype is torch.bfloat16


def test_attribute_map_is_inherited_from_the_transformers_class(tmp_path: Path) -> None:
    GPT2Config(n_embd=32, n_head=4, n_layer=1, vocab_size=50).save_pretrained(tmp_path)
    config = load(tmp_path)
    assert config.attribute_map["hidden_size"] == "n_embd"
    assert config.hidden_size == 32
    config.num_attention_heads = 8
    assert config.n_head == 8


def test_unknown_model_type_gives_the_raw_attributes(tmp_path: Path) -> None:
    raw = {"model_type": "my_model", "width": 8, "rope_parameters": {"rope_theta": 5.0}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load(tmp_path)
    assert (config.model_type, config.width) == ("my_model", 8)
    assert (config.rope_theta, config.rope_scaling) == (5.0, None)


def test_with_rope_aliases_leaves_per_layer_parameters_alone() -> None:
    per_layer = {"rope_parameters": {"full_attention": {"rope_theta": 1.0}}}
    assert with_rope_aliases(dict(per_layer)) == per_layer


def test_hf_config_instead_of_a_path() -> None:
    hf = LlamaConfig(**TINY, rope_scaling=llama3_rope(), max_position_embeddings=16384)
    config = InferenceConfig(NeuronConfig(), load_config=load_pretrained_config(hf_config=hf))
    assert config.hidden_size == 64
    assert config.rope_scaling == LLAMA3_ROPE


def test_exactly_one_source_is_required() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        load_pretrained_config()
    with pytest.raises(ValueError, match="exactly one"):
        load_pretrained_config("x", hf_config=LlamaConfig())


def test_loaded_config_round_trips(tmp_path: Path) -> None:
    hf = LlamaConfig(**TINY, rope_scaling=llama3_rope(), max_position_embeddings=16384)
    hf.save_pretrained(tmp_path / "model")
    config = load(tmp_path / "model", seq_len=64)
    config.save(tmp_path / "compiled")
    assert InferenceConfig.load(tmp_path / "compiled") == config


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "expected a JSON object"),
        ('{"model_type": "llama", "hidden_size": "wide"}', "LlamaConfig cannot read it"),
    ],
)
def test_malformed_config_json_names_the_file(tmp_path: Path, text: str, expected: str) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError) as excinfo:
        load(tmp_path)
    assert excinfo.value.source == str(tmp_path / "config.json")
    assert expected in str(excinfo.value)


def test_folder_without_a_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load(tmp_path)
    assert excinfo.value.source == str(tmp_path)
    assert "looked for: config.json" in str(excinfo.value)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "nowhere")


LOADER_MODULE = """
def read(model_path):
    return {"hidden_size": 5, "attribute_map": {"d_model": "hidden_size"}, "torch_dtype": "float16"}

def broken(model_path):
    return ["not", "a", "dict"]
"""


@pytest.fixture
def extra_loaders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, manager: NxdPlugPluginManager
) -> Path:
    """A second plugin with two loaders, in a module put on the path for the test."""
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "fake_config_loader.py").write_text(LOADER_MODULE)
    monkeypatch.syspath_prepend(str(modules))

    class FakeLoaders:
        @hookimpl
        def nxdplug_config_loaders(self) -> Iterator[ConfigLoader]:
            yield ConfigLoader(
                name="params", filenames=("params.json",), loader="fake_config_loader:read"
            )
            yield ConfigLoader(
                name="broken", filenames=("broken.txt",), loader="fake_config_loader:broken"
            )

    manager.register_plugin(FakeLoaders(), "fake-loaders")
    model = tmp_path / "model"
    model.mkdir()
    return model


def test_a_plugin_loader_is_used_when_its_file_is_there(extra_loaders: Path) -> None:
    (extra_loaders / "params.json").write_text("{}")
    config = load(extra_loaders)
    assert config.d_model == 5
    assert config.neuron_config.torch_dtype is torch.float16


def test_the_first_loader_with_a_file_wins(extra_loaders: Path) -> None:
    (extra_loaders / "params.json").write_text("{}")
    LlamaConfig(**TINY).save_pretrained(extra_loaders)
    names = [record.name for record in get_registry().records("config_loaders")]
    first = min(("hf-config-json", "params"), key=names.index)
    expected = {"hf-config-json": 64, "params": 5}[first]
    assert read_model_attributes(extra_loaders)["hidden_size"] == expected


def test_every_loaders_files_are_listed_when_none_is_found(extra_loaders: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load(extra_loaders)
    for name in ("config.json", "params.json", "broken.txt"):
        assert name in str(excinfo.value)


def test_a_loader_returning_a_non_dict_is_reported(extra_loaders: Path) -> None:
    (extra_loaders / "broken.txt").write_text("")
    with pytest.raises(ConfigError, match="config loader 'broken' returned list"):
        load(extra_loaders)
