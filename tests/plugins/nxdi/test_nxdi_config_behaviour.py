"""Config behaviour as NxD Inference's source has it (issue #43): what its constructors adjust,
warn about or raise, with the exception types a ported script may catch. Each expected value
is NxD Inference's behaviour, written out here; PEFT writes the adapters' configs."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from peft import LoraConfig

from nxdplug import from_pretrained
from nxdplug.cli.main import main
from nxdplug.config import (
    CONFIG_FILE,
    InferenceConfig,
    LoraServingConfig,
    MoENeuronConfig,
    NeuronConfig,
    OnDeviceSamplingConfig,
)
from nxdplug.errors import ConfigError
from tests.plugins.lora.test_lora import (
    ADAPTERS,
    MASK,
    NEW_TOKENS,
    PROMPTS,
    generate,
    peft_oracle,
    save_adapters,
)
from tests.plugins.lora.test_lora import ALL as ALL_TARGETS

SMALL = {"batch_size": 1, "seq_len": 32, "torch_dtype": "float32"}
# NxD Inference's messages (models/config.py), which a ported script may match on.
CAST_TYPE_MESSAGE = "cast_type must be one of config, as-declared"
ATTENTION_DTYPE_MESSAGE = (
    "attention dtype and torch dtype are different, however global cast is enabled. To enable "
    "running multiple precisions, set cast-type to 'as-declared'"
)


class ModelConfig(InferenceConfig):
    def get_required_attributes(self) -> list[str]:
        return ["hidden_size", "vocab_size"]


def saved_config(folder: Path, **changes) -> Path:
    """A ``neuron_config.json`` that ``InferenceConfig.save`` wrote, with ``changes`` made to
    its NeuronConfig (a value of None removes a model attribute instead)."""
    ModelConfig(NeuronConfig(), hidden_size=8, vocab_size=16).save(folder)
    path = folder / CONFIG_FILE
    data = json.loads(path.read_text())
    for name, value in changes.items():
        if value is None:
            del data[name]
        else:
            data["neuron_config"][name] = value
    path.write_text(json.dumps(data))
    return path


# -- NeuronConfig: precision settings refused at construction ----------------------------------


def test_an_unknown_cast_type_is_nxd_inferences_value_error() -> None:
    with pytest.raises(ValueError, match=CAST_TYPE_MESSAGE) as raised:
        NeuronConfig(cast_type="declared")
    assert isinstance(raised.value, ConfigError)


def test_an_attention_dtype_under_the_global_cast_is_nxd_inferences_assertion() -> None:
    with pytest.raises(AssertionError, match=ATTENTION_DTYPE_MESSAGE) as raised:
        NeuronConfig(attention_dtype="float32")  # torch_dtype is bfloat16
    assert isinstance(raised.value, ConfigError)
    assert "drop attention_dtype" in str(raised.value)
    mixed = NeuronConfig(attention_dtype="float32", cast_type="as-declared")
    assert (mixed.attention_dtype, mixed.torch_dtype) == (torch.float32, torch.bfloat16)
    assert NeuronConfig(attention_dtype="bfloat16").attention_dtype is torch.bfloat16


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"cast_type": "declared"}, ValueError, CAST_TYPE_MESSAGE),
        ({"attention_dtype": "float32"}, AssertionError, "set cast-type to 'as-declared'"),
        ({"hidden_size": None}, AssertionError, "requires the attribute 'hidden_size'"),
    ],
)
def test_a_saved_config_that_breaks_them_is_refused_naming_the_file(
    tmp_path, change, error, message
) -> None:
    path = saved_config(tmp_path, **change)
    with pytest.raises(error, match=message) as raised:
        ModelConfig.load(tmp_path)
    assert isinstance(raised.value, ConfigError)
    assert raised.value.source == str(path)


def test_the_command_line_says_it_in_one_error_without_a_traceback(capsys, tiny_checkpoint) -> None:
    paths = ["--model-path", str(tiny_checkpoint("llama")), "--compiled-model-path", "/tmp/x"]
    head = ["inference_demo", "--model-type", "llama", "--task-type", "causal-lm", "run", *paths]
    for flags, message in (
        (["--attention-dtype", "float32"], ATTENTION_DTYPE_MESSAGE),
        (["--cast-type", "declared"], CAST_TYPE_MESSAGE),
    ):
        assert main([*head, "--prompt", "hi", *flags]) == 1
        err = capsys.readouterr().err
        assert err.startswith("nxdplug: error: ") and message in err
        assert "Traceback" not in err


# -- InferenceConfig.validate_config -----------------------------------------------------------


def test_a_missing_required_attribute_is_an_assertion_naming_it() -> None:
    """NxD Inference asserts (``Config must define [...]``); here the AssertionError is also a
    ConfigError that names the attribute and how to set it."""
    with pytest.raises(AssertionError) as raised:
        ModelConfig(NeuronConfig(), hidden_size=8)
    assert isinstance(raised.value, ConfigError)
    (problem,) = raised.value.problems
    assert "'vocab_size'" in problem and "load_pretrained_config" in problem


# -- MoENeuronConfig: router_config and the router keywords ------------------------------------


def test_a_router_config_dict_wins_over_the_router_keywords() -> None:
    """NxD Inference builds the router from the dict and leaves ``router_act_fn`` /
    ``router_dtype`` unused (it logs them as unexpected); here a warning names them."""
    with pytest.warns(UserWarning, match="router_act_fn, router_dtype is ignored"):
        config = MoENeuronConfig(
            router_config={"act_fn": "sigmoid"}, router_act_fn="softmax", router_dtype="bfloat16"
        )
    assert config.router_config.act_fn == "sigmoid"
    assert config.router_config.dtype is torch.float32  # RouterConfig's default, not bfloat16
    keywords = MoENeuronConfig(router_act_fn="sigmoid", router_dtype="bfloat16").router_config
    assert (keywords.act_fn, keywords.dtype) == ("sigmoid", torch.bfloat16)


# -- OnDeviceSamplingConfig: a plain object, checked when used ---------------------------------


def test_the_sampling_config_takes_any_assignment_and_is_checked_when_used(
    tiny_checkpoint,
) -> None:
    """As NxD Inference's unit tests do (``sampling_config.global_topk = 0``,
    ``sampling_config.topk = 1``): assignment is accepted; building a model with it reports
    every bad value and unknown name."""
    sampling = OnDeviceSamplingConfig(do_sample=True)
    sampling.global_topk = 0
    sampling.topk = 1
    assert (sampling.global_topk, sampling.topk) == (0, 1)
    config = NeuronConfig(on_device_sampling_config=sampling, **SMALL)
    with pytest.raises(ConfigError) as raised:
        from_pretrained(tiny_checkpoint("llama"), config)
    problems = "\n".join(raised.value.problems)
    assert "on_device_sampling_config.global_topk is 0" in problems
    assert "no setting 'topk' (did you mean 'top_k'?)" in problems
    del sampling.topk
    sampling.global_topk = 50
    sampling.top_k = 5
    app = from_pretrained(tiny_checkpoint("llama"), config)
    assert app.neuron_config.on_device_sampling_config.top_k == 5


# -- glu_mlp: gated experts unless the config says otherwise -----------------------------------

MOE_SMALL = SMALL | {"seq_len": 64, "max_context_length": 32}


@pytest.mark.parametrize("architecture", ["mixtral", "qwen3_moe", "dbrx"])
def test_glu_mlp_left_unset_serves_gated_experts_and_only_false_is_refused(
    tiny_checkpoint, architecture
) -> None:
    """NxD Inference's MoENeuronConfig defaults ``glu_mlp`` to True; these families' experts
    are gated, so only an explicit ``glu_mlp=False`` contradicts the checkpoint."""
    path = tiny_checkpoint(architecture)
    assert MoENeuronConfig().glu_mlp is True
    app = from_pretrained(path, MoENeuronConfig(**MOE_SMALL))
    assert app.neuron_config.glu_mlp is True
    with pytest.raises(ConfigError, match="glu_mlp"):
        from_pretrained(path, MoENeuronConfig(glu_mlp=False, **MOE_SMALL))


# -- LoraServingConfig: fitted to the adapters' configs at construction ------------------------


def peft_config_folder(folder: Path, rank: int, targets: list[str]) -> str:
    """An adapter folder holding the adapter_config.json PEFT writes (no weights: construction
    reads only the config)."""
    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    """test_lora's two PEFT adapters (ranks 4 and 8, random B) of a tiny Llama."""
    checkpoint = tiny_checkpoint("llama", initializer_range=0.15)
    return checkpoint, save_adapters(checkpoint, tmp_path_factory.mktemp("adapters"), ADAPTERS)


def test_rank_and_targets_follow_the_adapters_and_the_config_serves_peft_tokens(
    adapters, tmp_path
) -> None:
    """Left at their defaults, max_loras rises to the adapters given and target_modules becomes
    the modules they train, with warnings; max_lora_rank stays 16, above their ranks (NxD
    Inference takes the larger). The fitted config compiles and gives PEFT's tokens."""
    checkpoint, paths = adapters
    with pytest.warns(UserWarning) as said:
        lora_config = LoraServingConfig(lora_ckpt_paths=paths)
    assert lora_config.max_loras == 2 and lora_config.max_lora_rank == 16
    assert sorted(lora_config.target_modules) == sorted(ALL_TARGETS)
    assert sum("max_loras" in str(w.message) for w in said) == 1
    assert sum("target_modules" in str(w.message) for w in said) == 1
    config = NeuronConfig(torch_dtype="float32", batch_size=3, seq_len=32, lora_config=lora_config)
    app = from_pretrained(checkpoint, config)
    app.compile(tmp_path / "compiled", quiet=True)
    app.load(tmp_path / "compiled", quiet=True)
    rows = ["code", "chat", None]
    with torch.no_grad():
        expected = peft_oracle(checkpoint, paths).generate(
            input_ids=PROMPTS,
            attention_mask=MASK,
            adapter_names=[row or "__base__" for row in rows],
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    assert torch.equal(generate(app, rows), expected)


def test_targets_that_cover_the_adapters_are_kept_without_a_warning(tmp_path) -> None:
    paths = {"a": peft_config_folder(tmp_path / "a", 4, ["q_proj", "v_proj"])}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lora = LoraServingConfig(
            target_modules=["q_proj", "k_proj", "v_proj"], lora_ckpt_paths=paths
        )
    assert lora.target_modules == ["q_proj", "k_proj", "v_proj"]
    assert (lora.max_loras, lora.max_lora_rank) == (1, 16)


def test_more_adapters_than_max_cpu_loras_is_nxd_inferences_value_error(tmp_path) -> None:
    """With dynamic multi-LoRA every adapter listed, in a slot or on the host, counts."""
    folders = {name: peft_config_folder(tmp_path / name, 4, ["q_proj"]) for name in "abc"}
    settings = {
        "max_loras": 1,
        "enable_dynamic_multi_lora": True,
        "lora_ckpt_paths": {"a": folders["a"]},
        "lora_ckpt_paths_cpu": {"b": folders["b"], "c": folders["c"]},
    }
    with pytest.raises(ValueError, match="can be hosted on CPU is 2") as raised:
        LoraServingConfig(max_cpu_loras=2, **settings)
    assert isinstance(raised.value, ConfigError)
    assert "specified in lora_ckpt_paths and lora_ckpt_paths_cpu is 3" in str(raised.value)
    assert LoraServingConfig(max_cpu_loras=3, **settings).max_cpu_loras == 3
    assert LoraServingConfig(**settings).max_cpu_loras == 100  # NxD Inference's default
    static = settings | {"enable_dynamic_multi_lora": False, "lora_ckpt_paths_cpu": None}
    assert LoraServingConfig(max_cpu_loras=0, **static).max_cpu_loras == 0  # host unused


def test_adapters_as_nxd_inferences_list_of_id_and_path(tmp_path) -> None:
    folders = {name: peft_config_folder(tmp_path / name, 4, ["q_proj"]) for name in "ab"}
    with pytest.warns(UserWarning, match="max_loras raised from 1 to 2"):
        lora = LoraServingConfig(lora_ckpt_paths=[f"a : {folders['a']}", f"b:{folders['b']}"])
    assert lora.adapter_paths() == {"a": Path(folders["a"]), "b": Path(folders["b"])}
    with pytest.raises(ConfigError, match="expected 'ADAPTER_ID : PATH'"):
        LoraServingConfig(lora_ckpt_paths=["no-colon"]).adapter_paths()
