"""InferenceConfig: attributes, hooks, aliases, required attributes, JSON round trips, errors."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from nxdplug.config import (
    CONFIG_FILE,
    FusedSpecNeuronConfig,
    InferenceConfig,
    LoraServingConfig,
    MoENeuronConfig,
    NeuronConfig,
    OnDeviceSamplingConfig,
    core_config_problems,
    load_pretrained_config,
)
from nxdplug.config.neuron_config import LNC_ENV
from nxdplug.errors import ConfigError
from nxdplug.manager import create_plugin_manager, use_plugin_manager


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(LNC_ENV, raising=False)


class ModelInferenceConfig(InferenceConfig):
    def get_required_attributes(self) -> list[str]:
        return ["hidden_size", "num_attention_heads", "vocab_size"]


class MoEInferenceConfig(InferenceConfig):
    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return MoENeuronConfig


class AliasedConfig(InferenceConfig):
    attribute_map = {"n_embd": "hidden_size"}


def round_trip(config: InferenceConfig, folder: Path) -> InferenceConfig:
    config.save(folder)
    return type(config).load(folder)


def test_kwargs_become_attributes() -> None:
    config = InferenceConfig(NeuronConfig(), hidden_size=64, metadata={"note": "x"})
    assert config.hidden_size == 64
    assert config.metadata == {"note": "x"}
    assert config.fused_spec_config is None


def test_load_config_hook_runs_before_kwargs_override() -> None:
    def hook(config: InferenceConfig) -> None:
        config.hidden_size = 32
        config.vocab_size = 100

    config = InferenceConfig(NeuronConfig(), load_config=hook, hidden_size=64)
    assert (config.hidden_size, config.vocab_size) == (64, 100)


def test_load_config_method_runs_without_a_hook() -> None:
    class Loading(InferenceConfig):
        def load_config(self) -> None:
            self.loaded = True

    assert Loading(NeuronConfig()).loaded is True


def test_attribute_map_get_and_set_reach_the_original() -> None:
    config = AliasedConfig(NeuronConfig(), hidden_size=64)
    assert config.n_embd == 64
    config.n_embd = 128
    assert config.hidden_size == 128
    assert "n_embd" not in vars(config)
    assert AliasedConfig(NeuronConfig(), n_embd=32).hidden_size == 32
    with pytest.raises(AttributeError, match="no_such"):
        _ = config.no_such


def test_instance_attribute_map_is_saved_and_restored(tmp_path: Path) -> None:
    config = InferenceConfig(NeuronConfig(), attribute_map={"d_model": "hidden_size"}, d_model=8)
    assert config.hidden_size == 8
    loaded = round_trip(config, tmp_path)
    assert loaded == config
    assert loaded.d_model == 8


def test_missing_required_attributes_are_all_listed() -> None:
    with pytest.raises(ConfigError) as excinfo:
        ModelInferenceConfig(NeuronConfig(), hidden_size=64)
    assert isinstance(excinfo.value, AssertionError)  # NxD Inference asserts
    problems = excinfo.value.problems
    assert len(problems) == 2
    assert "'num_attention_heads'" in problems[0]
    assert "'vocab_size'" in problems[1]


def test_required_attributes_may_be_dotted_or_aliases() -> None:
    class Nested(AliasedConfig):
        def get_required_attributes(self) -> list[str]:
            return ["n_embd", "text_config.head_dim"]

    class TextConfig:
        head_dim = 16

    Nested(NeuronConfig(), hidden_size=4, text_config=TextConfig())
    with pytest.raises(ConfigError, match=r"text_config\.head_dim"):
        Nested(NeuronConfig(), hidden_size=4, text_config=object())


def test_round_trip_plain(tmp_path: Path) -> None:
    config = InferenceConfig(NeuronConfig(), hidden_size=64, rope_scaling=None, layers=[1, 2])
    loaded = round_trip(config, tmp_path)
    assert loaded == config
    assert loaded.neuron_config.torch_dtype is torch.bfloat16


def test_round_trip_nested_configs(tmp_path: Path) -> None:
    neuron_config = NeuronConfig(
        torch_dtype="float32",
        rpl_reduce_dtype=torch.float32,
        attention_dtype="float32",
        on_device_sampling_config=OnDeviceSamplingConfig(do_sample=True, top_k=50, top_p=0.9),
        lora_config=LoraServingConfig(max_loras=2, lora_ckpt_paths={"a": "/tmp/a"}),
        enable_bucketing=True,
        seq_len=512,
        medusa_tree=[[0], [0, 1]],
        plugin_setting={"k": 1},
    )
    config = ModelInferenceConfig(
        neuron_config, hidden_size=64, num_attention_heads=4, vocab_size=9
    )
    loaded = round_trip(config, tmp_path)
    assert loaded == config
    assert loaded.neuron_config.on_device_sampling_config.top_p == 0.9
    assert loaded.neuron_config.rpl_reduce_dtype is torch.float32
    assert loaded.neuron_config.plugin_setting == {"k": 1}


def test_round_trip_fused_spec_config_with_draft(tmp_path: Path) -> None:
    target = InferenceConfig(NeuronConfig(enable_eagle_speculation=True, speculation_length=4))
    draft_neuron_config = copy.deepcopy(target.neuron_config)
    draft_neuron_config.enable_fused_speculation = False
    draft_neuron_config.is_eagle_draft = True
    draft = InferenceConfig(draft_neuron_config, hidden_size=32)
    target.fused_spec_config = FusedSpecNeuronConfig(
        torch.nn.Linear, draft_config=draft, draft_model_path="/models/draft"
    )
    saved = json.loads(target.to_json_string())
    assert saved["fused_spec_config"]["worker_cls"] == "torch.nn.modules.linear:Linear"
    loaded = round_trip(target, tmp_path)
    assert loaded == target
    assert loaded.fused_spec_config.worker_cls is torch.nn.Linear
    assert loaded.fused_spec_config.draft_config.neuron_config.is_eagle_draft is True
    assert loaded.fused_spec_config.draft_config.neuron_config.enable_fused_speculation is False


def test_round_trip_moe_neuron_config_through_get_neuron_config_cls(tmp_path: Path) -> None:
    neuron_config = MoENeuronConfig(
        router_config={"act_fn": "sigmoid", "dtype": "bfloat16"},
        hybrid_sharding_config={"moe_cte_tp_degree": 2},
        blockwise_matmul_config={"block_size": 256, "blockwise_nki_autograd_cls": torch.nn.Linear},
        capacity_factor=1.5,
    )
    config = MoEInferenceConfig(neuron_config, num_local_experts=8)
    loaded = round_trip(config, tmp_path)
    assert type(loaded.neuron_config) is MoENeuronConfig
    assert loaded == config
    assert loaded.neuron_config.router_config.dtype is torch.bfloat16
    assert (
        loaded.neuron_config.blockwise_matmul_config.blockwise_nki_autograd_cls is torch.nn.Linear
    )


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    batch_size=st.integers(1, 64),
    seq_len=st.integers(1, 1 << 16),
    context_fraction=st.floats(0.0, 1.0),
    dtype=st.sampled_from([torch.bfloat16, "float16", "torch.float32", torch.float64]),
    speculation_length=st.integers(0, 16),
    top_p=st.floats(0.0, 1.0, allow_nan=False),
    temperature=st.floats(0.01, 100.0),
    bucketing=st.booleans(),
    hidden_size=st.integers(1, 1 << 20),
    rms_norm_eps=st.floats(allow_nan=False, allow_infinity=False),
)
def test_round_trip_property(
    tmp_path: Path,
    batch_size: int,
    seq_len: int,
    context_fraction: float,
    dtype: object,
    speculation_length: int,
    top_p: float,
    temperature: float,
    bucketing: bool,
    hidden_size: int,
    rms_norm_eps: float,
) -> None:
    neuron_config = NeuronConfig(
        batch_size=batch_size,
        seq_len=seq_len,
        max_context_length=max(1, int(seq_len * context_fraction)),
        torch_dtype=dtype,
        speculation_length=speculation_length,
        on_device_sampling_config={"top_p": top_p, "temperature": temperature},
        enable_bucketing=bucketing,
    )
    config = InferenceConfig(neuron_config, hidden_size=hidden_size, rms_norm_eps=rms_norm_eps)
    assert InferenceConfig.from_json_string(config.to_json_string()) == config
    assert round_trip(config, tmp_path) == config


def test_load_kwargs_override_saved_attributes(tmp_path: Path) -> None:
    InferenceConfig(NeuronConfig(batch_size=2), hidden_size=64, vocab_size=10).save(tmp_path)
    loaded = InferenceConfig.load(
        tmp_path, hidden_size=128, neuron_config=NeuronConfig(tp_degree=2)
    )
    assert loaded.hidden_size == 128
    assert loaded.vocab_size == 10
    assert loaded.neuron_config.tp_degree == 2
    from_string = InferenceConfig.from_json_string(
        (tmp_path / CONFIG_FILE).read_text(), vocab_size=11
    )
    assert from_string.vocab_size == 11
    assert InferenceConfig.from_json_file(tmp_path / CONFIG_FILE, vocab_size=12).vocab_size == 12


def test_from_dict_and_to_dict() -> None:
    config = InferenceConfig(NeuronConfig(seq_len=64), hidden_size=8)
    data = config.to_dict()
    assert data["neuron_config"]["torch_dtype"] == "bfloat16"
    assert InferenceConfig.from_dict(data) == config
    assert InferenceConfig.from_dict(data, hidden_size=9).hidden_size == 9


def test_save_writes_atomically_and_creates_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "compiled" / "model"
    config = InferenceConfig(NeuronConfig(), hidden_size=64)
    config.save(folder)
    config.save(folder)  # replacing an existing file
    assert [p.name for p in folder.iterdir()] == [CONFIG_FILE]
    assert json.loads((folder / CONFIG_FILE).read_text())["hidden_size"] == 64
    config.to_json_file(tmp_path / "elsewhere.json")
    assert InferenceConfig.from_json_file(tmp_path / "elsewhere.json") == config


def test_unserializable_attribute_is_reported_with_its_place(tmp_path: Path) -> None:
    config = InferenceConfig(NeuronConfig(), hook=lambda: None)
    with pytest.raises(ConfigError, match=r"InferenceConfig\.hook holds a function"):
        config.save(tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"neuron_config": {', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"hidden_size": 4}', "no 'neuron_config' entry"),
        ('{"neuron_config": {"on_device_sampling_config": {"topk": 1}}}', "did you mean 'top_k'"),
        ('{"neuron_config": {}, "fused_spec_config": {"worker_cls": "no.such:Cls"}}', "no.such"),
        ('{"neuron_config": {}, "fused_spec_config": {"worker": 1}}', "worker_cls"),
        ('{"neuron_config": {"lora_config": 3}}', "lora_config must be"),
    ],
)
def test_bad_json_file_is_a_config_error_naming_the_file(
    tmp_path: Path, text: str, expected: str
) -> None:
    json_file = tmp_path / CONFIG_FILE
    json_file.write_text(text)
    with pytest.raises(ConfigError) as excinfo:
        InferenceConfig.load(tmp_path)
    assert excinfo.value.source == str(json_file)
    assert str(json_file) in str(excinfo.value)
    assert expected in str(excinfo.value)


def test_required_attribute_missing_from_file_names_the_file(tmp_path: Path) -> None:
    InferenceConfig(NeuronConfig(), hidden_size=4).save(tmp_path)
    with pytest.raises(ConfigError) as excinfo:
        ModelInferenceConfig.load(tmp_path)
    assert excinfo.value.source == str(tmp_path / CONFIG_FILE)
    assert len(excinfo.value.problems) == 2


def test_load_from_a_folder_without_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=CONFIG_FILE):
        InferenceConfig.load(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        InferenceConfig.from_json_file(tmp_path / "missing.json")


@pytest.fixture
def only_hf_config_plugin() -> Iterator[None]:
    with use_plugin_manager(create_plugin_manager(allow=frozenset({"hf_config"}))):
        yield


@pytest.mark.usefixtures("only_hf_config_plugin")
def test_feature_guide_eagle_flow(tmp_path: Path) -> None:
    """The fused-speculation example of the feature guide, on tiny local checkpoints."""
    model_path, draft_model_path = tmp_path / "target", tmp_path / "draft"
    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 64}
    LlamaConfig(num_attention_heads=4, **tiny).save_pretrained(model_path)
    LlamaConfig(num_attention_heads=2, **tiny).save_pretrained(draft_model_path)
    max_sequence_length = 256

    on_device_sampling_config = OnDeviceSamplingConfig(temperature=0.7, top_k=50, top_p=1.0)
    neuron_config = NeuronConfig(
        batch_size=1,
        enable_eagle_speculation=True,
        enable_fused_speculation=True,
        max_context_length=max_sequence_length,
        max_length=max_sequence_length,
        on_device_sampling_config=on_device_sampling_config,
        seq_len=max_sequence_length,
        speculation_length=5,
        tp_degree=2,
        trace_tokengen_model=False,
    )
    config = ModelInferenceConfig(neuron_config, load_config=load_pretrained_config(model_path))

    draft_neuron_config = copy.deepcopy(neuron_config)
    draft_neuron_config.trace_tokengen_model = True
    draft_neuron_config.enable_fused_speculation = False
    draft_neuron_config.is_eagle_draft = True
    draft_neuron_config.sequence_parallel_enabled = False
    draft_config = ModelInferenceConfig(
        draft_neuron_config, load_config=load_pretrained_config(draft_model_path)
    )
    config.fused_spec_config = FusedSpecNeuronConfig(
        torch.nn.Linear, draft_config=draft_config, draft_model_path=str(draft_model_path)
    )

    assert core_config_problems(config) == []
    assert core_config_problems(draft_config) == []
    assert config.num_attention_heads == 4 and draft_config.num_attention_heads == 2
    assert round_trip(config, tmp_path / "compiled") == config
