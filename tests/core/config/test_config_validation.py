"""core_config_problems and unknown_attribute_problems: every rule can fail, with its message."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nxdplug.config import (
    InferenceConfig,
    NeuronConfig,
    OnDeviceSamplingConfig,
    core_config_problems,
    unknown_attribute_problems,
)
from nxdplug.config.neuron_config import LNC_ENV
from nxdplug.errors import ConfigError
from nxdplug.hookspecs import hookimpl
from nxdplug.pipeline import config_problems
from nxdplug.testing import temporary_plugin
from nxdplug.types import QuantizationMethod


@pytest.fixture(autouse=True)
def _no_lnc_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LNC_ENV, raising=False)


def problems_of(model: dict[str, Any] | None = None, **neuron: Any) -> list[str]:
    model = {"num_attention_heads": 8} if model is None else model
    config = InferenceConfig(NeuronConfig(**neuron), **model)
    return core_config_problems(config)


def test_a_valid_config_has_no_problems() -> None:
    assert problems_of() == []
    assert (
        problems_of(
            tp_degree=8,
            batch_size=4,
            seq_len=2048,
            max_context_length=1024,
            sequence_parallel_enabled=True,
            fused_qkv=True,
            qkv_kernel_enabled=True,
            mlp_kernel_enabled=True,
            quantized_mlp_kernel_enabled=True,
            rmsnorm_quantize_kernel_enabled=True,
            on_device_sampling_config=OnDeviceSamplingConfig(),
            speculation_length=4,
            enable_eagle_speculation=True,
            enable_bucketing=True,
            quantized=True,
            quantized_checkpoints_path="/q",
            quantization_dtype="f8e4m3",
            quantization_type="per_channel_symmetric",
            is_medusa=True,
            num_medusa_heads=4,
            medusa_speculation_length=64,
            attention_dtype=torch.float32,
            cast_type="as-declared",
            padding_side="left",
            lora_config={"max_loras": 2},
        )
        == []
    )


# (neuron config keywords, model attributes or None for the default, expected message part)
FAILING = [
    ({"async_mode": True}, None, "async_mode=True needs on-device sampling"),
    (
        {"async_mode": True, "on_device_sampling_config": {}, "speculation_length": 3},
        None,
        "async_mode=True with speculative decoding is not implemented",
    ),
    (
        {"tp_degree": 2},
        {"num_attention_heads": 8, "num_key_value_heads": 3},
        "num_attention_heads (8) is not a multiple of num_key_value_heads (3)",
    ),
    (
        {"sequence_parallel_enabled": True, "tp_degree": 4, "seq_len": 130},
        None,
        "max_context_length (130) divisible by tp_degree (4)",
    ),
    (
        {"seq_len": 128, "max_context_length": 256},
        None,
        "max_context_length (256) is larger than seq_len (128)",
    ),
    (
        {"seq_len": 512, "max_context_length": 256, "max_length": 128},
        None,
        "max_context_length (256) is larger than max_length (128)",
    ),
    ({"batch_size": 0}, None, "batch_size is 0; it must be a whole number, 1 or more"),
    ({"tkg_batch_size": -1}, None, "tkg_batch_size is -1"),
    ({"ctx_batch_size": 1.5}, None, "ctx_batch_size is 1.5"),
    ({"speculation_length": -1}, None, "speculation_length is -1; it must be a whole number, 0"),
    (
        {"enable_bucketing": True, "context_encoding_buckets": [256, 128]},
        None,
        "context_encoding_buckets [256, 128] are not in increasing order",
    ),
    (
        {"enable_bucketing": True, "token_generation_buckets": [64, 64]},
        None,
        "not in increasing order; sort them and remove repeats: [64]",
    ),
    (
        {"enable_bucketing": True, "context_encoding_buckets": [0, 64]},
        None,
        "give a non-empty list of positive whole numbers",
    ),
    ({"context_encoding_buckets": []}, None, "give a non-empty list"),
    (
        {"context_encoding_buckets": [64, 256]},
        None,
        "the largest of context_encoding_buckets (256) exceeds max_context_length (128)",
    ),
    (
        {"token_generation_buckets": [64, 512]},
        None,
        "the largest of token_generation_buckets (512) exceeds max_length (128)",
    ),
    (
        {"token_generation_buckets": [64, 512], "max_length": 1024},
        None,
        "the largest of token_generation_buckets (512) exceeds seq_len (128)",
    ),
    ({"padding_side": "top"}, None, "padding_side is 'top'; choose one of 'left', 'right'"),
    ({"padding_side": "lfet"}, None, "'lfet' (did you mean 'left'?)"),
    ({"torch_dtype": "int8"}, None, "torch_dtype is int8; use one of bfloat16, float16, float32"),
    ({"torch_dtype": "bf16"}, None, "torch_dtype is 'bf16'"),
    ({"rpl_reduce_dtype": torch.float64}, None, "rpl_reduce_dtype is float64"),
    ({"on_device_sampling_config": {"top_p": 0.0}}, None, "top_p is 0.0; it must be in (0, 1]"),
    ({"on_device_sampling_config": {"temperature": 0}}, None, "temperature is 0"),
    ({"on_device_sampling_config": {"global_topk": 0}}, None, "global_topk is 0"),
    ({"lora_config": {"max_loras": 0}}, None, "lora_config.max_loras is 0"),
    ({"tp_degree": 0}, None, "tp_degree is 0"),
    (
        {
            "sequence_parallel_enabled": True,
            "tp_degree": 2,
            "enable_bucketing": True,
            "context_encoding_buckets": [63, 128],
        },
        None,
        "context_encoding_buckets [63] do not divide by it",
    ),
    ({"n_positions": 64}, None, "n_positions (64) is the number of KV-cache positions"),
    ({"n_active_tokens": 1}, None, "n_active_tokens (1) is set per sub-model"),
]


@pytest.mark.parametrize(("neuron", "model", "expected"), FAILING)
def test_each_rule_reports_its_problem(
    neuron: dict[str, Any], model: dict[str, Any] | None, expected: str
) -> None:
    problems = problems_of(model, **neuron)
    assert any(expected in problem for problem in problems), problems


def test_precision_settings_are_refused_at_construction_as_nxd_inference_does() -> None:
    """An unknown cast_type is NxD Inference's ValueError, an attention dtype under the global
    cast its AssertionError (both config errors); set later, validation still reports them."""
    with pytest.raises(ValueError, match="cast_type must be one of config, as-declared"):
        NeuronConfig(cast_type="declared")
    with pytest.raises(AssertionError, match="set cast_type='as-declared'") as raised:
        NeuronConfig(attention_dtype="float32")
    assert isinstance(raised.value, ConfigError)
    config = InferenceConfig(NeuronConfig(), num_attention_heads=8)
    config.neuron_config.cast_type = "declared"
    assert any("cast_type is 'declared'" in p for p in core_config_problems(config))
    config.neuron_config.cast_type = "config"
    config.neuron_config.attention_dtype = torch.float32
    assert any("needs cast_type='as-declared'" in p for p in core_config_problems(config))


# What a feature needs of the rest of the config: its plugin's check, run by config_problems
# when the config enables it (neuron config keywords, expected message part).
PLUGIN_RULES = [
    ({"qkv_kernel_enabled": True}, "qkv_kernel_enabled needs fused_qkv=True"),
    (
        {"qkv_kernel_enabled": True, "fused_qkv": True, "torch_dtype": "float32"},
        "qkv_kernel_enabled needs torch_dtype bfloat16 (it is float32)",
    ),
    (
        {"mlp_kernel_enabled": True, "torch_dtype": "float16"},
        "mlp_kernel_enabled needs torch_dtype bfloat16",
    ),
    ({"quantized_mlp_kernel_enabled": True}, "needs mlp_kernel_enabled=True"),
    ({"rmsnorm_quantize_kernel_enabled": True}, "needs quantized_mlp_kernel_enabled=True"),
    ({"quantized": True}, "quantized=True needs quantized_checkpoints_path"),
    (
        {"quantized": True, "quantization_dtype": "nf4"},
        "choose one of 'int8', 'f8e4m3', 'f8e5m2', 'int4'",
    ),
    ({"quantized": True, "quantization_type": "per_row"}, "quantization_type is 'per_row'"),
    ({"is_medusa": True, "medusa_speculation_length": 4}, "needs num_medusa_heads of 1"),
    ({"enable_eagle_speculation": True}, "needs speculation_length 1 or more (it is 0)"),
]


@pytest.mark.parametrize(("neuron", "expected"), PLUGIN_RULES)
def test_each_feature_rule_is_its_plugins_check(plugin_manager, neuron, expected) -> None:
    config = InferenceConfig(NeuronConfig(**neuron), num_attention_heads=8)
    assert not any(expected in problem for problem in core_config_problems(config))
    problems = config_problems(config)
    assert any(expected in problem for problem in problems), problems


def test_heads_are_checked_only_when_the_model_has_them() -> None:
    assert problems_of({}, tp_degree=3) == []


@pytest.mark.parametrize(("tp_degree", "kv_heads"), [(3, 8), (16, 8), (32, 2), (6, 4)])
def test_query_heads_that_do_not_divide_by_tp_degree_are_padded_not_refused(
    tp_degree: int, kv_heads: int
) -> None:
    model = {"num_attention_heads": 8, "num_key_value_heads": kv_heads}
    assert problems_of(model, tp_degree=tp_degree) == []


def test_several_problems_are_reported_together() -> None:
    problems = problems_of(batch_size=0, padding_side="up", torch_dtype="int8", tp_degree=0)
    assert len(problems) == 4


def test_a_bad_value_copied_into_derived_settings_is_reported_once() -> None:
    assert problems_of(batch_size=0) == ["batch_size is 0; it must be a whole number, 1 or more"]
    assert len(problems_of(seq_len=0)) == 1
    assert len(problems_of(batch_size=0, tkg_batch_size=0.5)) == 2


def test_attributes_set_after_construction_are_checked() -> None:
    config = InferenceConfig(NeuronConfig(), num_attention_heads=8, num_key_value_heads=8)
    config.num_key_value_heads = 3
    assert core_config_problems(config) == [
        "num_attention_heads (8) is not a multiple of num_key_value_heads (3)"
    ]


def test_missing_neuron_config_is_a_problem() -> None:
    config = InferenceConfig(None)
    (problem,) = core_config_problems(config)
    assert "not a NeuronConfig" in problem


def test_known_attributes_are_not_reported() -> None:
    assert unknown_attribute_problems(NeuronConfig(batch_size=2)) == []


def test_unknown_attribute_with_did_you_mean() -> None:
    (problem,) = unknown_attribute_problems(NeuronConfig(batch_sise=2))
    assert "'batch_sise'" in problem
    assert "did you mean 'batch_size'?" in problem


def test_unknown_attribute_set_after_construction() -> None:
    config = NeuronConfig()
    config.speculaton_length = 3
    config.zzz = 1
    problems = unknown_attribute_problems(config)
    assert len(problems) == 2
    assert "did you mean 'speculation_length'?" in problems[0]
    assert "'zzz'" in problems[1] and "did you mean" not in problems[1]


def test_unknown_attribute_declared_by_a_plugin_is_accepted() -> None:
    config = NeuronConfig(logit_softcap=30.0, logit_softcp=1.0)
    (problem,) = unknown_attribute_problems(config, extra_known=["logit_softcap"])
    assert "'logit_softcp'" in problem and "did you mean 'logit_softcap'?" in problem


def test_private_attributes_are_not_settings() -> None:
    config = NeuronConfig()
    config._compiled_for = "cpu"
    assert unknown_attribute_problems(config) == []


class Nf4Methods:
    """A third party's quantization method, as the hook reference's example registers it."""

    @hookimpl
    def nxdplug_quantization_methods(self):
        yield QuantizationMethod(
            name="nf4-per_channel",
            dtype="nf4",
            granularity="per_channel",
            implementation="collections:OrderedDict",
        )


def test_a_registered_third_party_dtype_is_accepted(plugin_manager) -> None:
    neuron = NeuronConfig(
        quantized=True,
        quantization_dtype="nf4",
        quantization_type="per_channel_symmetric",
        quantized_checkpoints_path="/q",
    )
    config = InferenceConfig(neuron, num_attention_heads=8)
    assert any("quantization_dtype is 'nf4'" in p for p in config_problems(config))
    with temporary_plugin(Nf4Methods(), "nf4"):
        assert not any("quantization_dtype" in p for p in config_problems(config))
