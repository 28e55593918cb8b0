"""NeuronConfig and its sub-configs: defaults, derived defaults, buckets, mutation, aliases."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from nxdplug.config import (
    BlockwiseMatmulConfig,
    HybridShardingConfig,
    LoraServingConfig,
    MoEFusedTKGConfig,
    MoENeuronConfig,
    NeuronConfig,
    OnDeviceSamplingConfig,
    RoutedExpertsMLPOpsConfig,
    RouterConfig,
    to_torch_dtype,
)
from nxdplug.config.neuron_config import LNC_ENV
from nxdplug.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_lnc_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LNC_ENV, raising=False)


# The documented defaults (api-reference.rst, and the older names of api-reference-older.txt).
NEURON_DEFAULTS = {
    "batch_size": 1,
    "padding_side": "right",
    "seq_len": 128,
    "max_context_length": 128,
    "max_new_tokens": None,
    "max_length": 128,
    "allow_input_truncation": False,
    "n_active_tokens": 128,
    "n_positions": 128,
    "torch_dtype": torch.bfloat16,
    "rpl_reduce_dtype": None,
    "cast_type": "config",
    "async_mode": False,
    "save_sharded_checkpoint": True,
    "logical_nc_config": 1,
    "skip_sharding": False,
    "weights_to_skip_layout_optimization": [],
    "skip_warmup": False,
    "scratchpad_page_size": None,
    "tp_degree": 1,
    "flash_decoding_enabled": False,
    "fused_qkv": False,
    "sequence_parallel_enabled": False,
    "qk_layernorm": False,
    "attention_dtype": None,
    "on_device_sampling_config": None,
    "enable_bucketing": False,
    "context_encoding_buckets": None,
    "token_generation_buckets": None,
    "quantized": False,
    "quantized_checkpoints_path": None,
    "quantization_dtype": "int8",
    "quantization_type": "per_tensor_symmetric",
    "modules_to_not_convert": None,
    "draft_model_modules_to_not_convert": None,
    "kv_cache_quant": False,
    "attn_kernel_enabled": False,
    "qkv_kernel_enabled": False,
    "mlp_kernel_enabled": False,
    "quantized_mlp_kernel_enabled": False,
    "rmsnorm_quantize_kernel_enabled": False,
    "is_continuous_batching": False,
    "max_batch_size": 1,
    "ctx_batch_size": 1,
    "tkg_batch_size": 1,
    "token_generation_batches": None,
    "chunked_prefill_config": None,
    "speculation_length": 0,
    "spec_batch_size": 1,
    "enable_eagle_speculation": False,
    "enable_eagle_draft_input_norm": False,
    "enable_fused_speculation": False,
    "trace_tokengen_model": True,
    "is_eagle_draft": False,
    "is_eagle3": False,
    "token_tree_config": None,
    "enable_token_tree": False,
    "is_medusa": False,
    "medusa_speculation_length": 0,
    "num_medusa_heads": 0,
    "medusa_tree": None,
    "lora_config": None,
    "cc_pipeline_tiling_factor": 2,
    "output_logits": False,
    "compile_backend": None,
    "on_cpu": False,
    "overrides_torch_dtype": False,
}

MOE_DEFAULTS = {
    "moe_tp_degree": 1,
    "moe_ep_degree": 1,
    "hybrid_sharding_config": None,
    "router_config": RouterConfig(act_fn="softmax", dtype=torch.float32),
    "return_expert_index": False,
    "return_router_logits": False,
    "blockwise_matmul_config": BlockwiseMatmulConfig(),
    "capacity_factor": None,
    "glu_mlp": True,  # NxD Inference's default
    "glu_type": "glu",
    "hidden_act_scaling_factor": 1.0,
    "hidden_act_bias": 0.0,
    "gate_clamp_upper_limit": None,
    "gate_clamp_lower_limit": None,
    "up_clamp_upper_limit": None,
    "up_clamp_lower_limit": None,
    "use_index_calc_kernel": False,
    "early_expert_affinity_modulation": False,
    "normalize_top_k_affinities": True,
    "fused_shared_experts": False,
    "shared_experts_sequence_parallel_enabled": False,
    "transpose_shared_experts_weights": False,
}


@pytest.mark.parametrize(("name", "default"), NEURON_DEFAULTS.items())
def test_neuron_config_default(name: str, default: object) -> None:
    assert getattr(NeuronConfig(), name) == default


def test_every_declared_field_has_a_documented_default() -> None:
    assert NeuronConfig.known_attribute_names() == frozenset(NEURON_DEFAULTS)


@pytest.mark.parametrize(("name", "default"), MOE_DEFAULTS.items())
def test_moe_neuron_config_default(name: str, default: object) -> None:
    assert getattr(MoENeuronConfig(), name) == default


def test_moe_known_names_include_base_and_subclass_fields() -> None:
    names = MoENeuronConfig.known_attribute_names()
    assert names == frozenset(NEURON_DEFAULTS) | frozenset(MOE_DEFAULTS)
    assert isinstance(MoENeuronConfig(), NeuronConfig)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            {"seq_len": 1024},
            {
                "max_context_length": 1024,
                "max_new_tokens": None,
                "max_length": 1024,
                "n_active_tokens": 1024,
                "n_positions": 1024,
            },
        ),
        ({"seq_len": 1024, "max_context_length": 256}, {"max_new_tokens": 768}),
        ({"seq_len": 512, "max_new_tokens": 7}, {"max_new_tokens": 7}),
        (
            {"batch_size": 4},
            {"max_batch_size": 4, "ctx_batch_size": 4, "tkg_batch_size": 4, "spec_batch_size": 4},
        ),
        ({"batch_size": 4, "tkg_batch_size": 2}, {"ctx_batch_size": 4, "tkg_batch_size": 2}),
        ({"enable_eagle_speculation": True}, {"enable_fused_speculation": True}),
        (
            {"enable_eagle_speculation": True, "enable_fused_speculation": False},
            {"enable_fused_speculation": False},
        ),
        ({"torch_dtype": "float32"}, {"torch_dtype": torch.float32, "overrides_torch_dtype": True}),
        ({"torch_dtype": torch.bfloat16}, {"overrides_torch_dtype": True}),
        (
            {"lora_config": {"enable_dynamic_multi_lora": True}},
            {"weights_to_skip_layout_optimization": [r".*lora.*"]},
        ),
    ],
)
def test_derived_defaults(kwargs: dict, expected: dict) -> None:
    config = NeuronConfig(**kwargs)
    assert {name: getattr(config, name) for name in expected} == expected


@pytest.mark.parametrize(
    ("value", "dtype"),
    [
        ("bfloat16", torch.bfloat16),
        ("float32", torch.float32),
        ("torch.float16", torch.float16),
        (torch.float16, torch.float16),
    ],
)
def test_dtype_fields_accept_names_and_dtypes(value: object, dtype: torch.dtype) -> None:
    config = NeuronConfig(torch_dtype=value, rpl_reduce_dtype=value, attention_dtype=value)
    assert config.torch_dtype is dtype
    assert config.rpl_reduce_dtype is dtype
    assert config.attention_dtype is dtype


def test_unknown_dtype_name_is_kept_for_validation_to_report() -> None:
    assert to_torch_dtype("bf16") == "bf16"
    assert NeuronConfig(torch_dtype="bf16").torch_dtype == "bf16"


def test_dtype_set_after_construction_is_converted() -> None:
    config = NeuronConfig()
    config.torch_dtype = "float16"
    assert config.torch_dtype is torch.float16


def test_automatic_buckets_when_bucketing_is_enabled() -> None:
    # NxD Inference's rounding: no 256 bucket below 300 (log2(300) rounds to 8); the table of
    # generate_buckets is in test_buckets.py.
    config = NeuronConfig(enable_bucketing=True, seq_len=1000, max_context_length=300)
    assert config.context_encoding_buckets == [128, 300]
    assert config.token_generation_buckets == [128, 256, 512, 1000]


def test_automatic_buckets_for_short_sequences() -> None:
    config = NeuronConfig(enable_bucketing=True, seq_len=64)
    assert config.context_encoding_buckets == [64]
    assert config.token_generation_buckets == [64]


def test_given_buckets_are_kept() -> None:
    config = NeuronConfig(
        enable_bucketing=True,
        seq_len=8192,
        context_encoding_buckets=(1024, 2048, 4096),
        token_generation_buckets=[8192],
    )
    assert config.context_encoding_buckets == [1024, 2048, 4096]
    assert config.token_generation_buckets == [8192]


def test_buckets_stay_unset_without_bucketing() -> None:
    config = NeuronConfig(seq_len=4096)
    assert config.context_encoding_buckets is None
    assert config.token_generation_buckets is None


def test_deepcopy_then_setattr_as_in_the_feature_guide() -> None:
    neuron_config = NeuronConfig(speculation_length=5, trace_tokengen_model=False)
    draft = copy.deepcopy(neuron_config)
    draft.speculation_length = 0
    draft.trace_tokengen_model = True
    draft.is_eagle_draft = True
    assert (draft.speculation_length, draft.trace_tokengen_model) == (0, True)
    assert (neuron_config.speculation_length, neuron_config.trace_tokengen_model) == (5, False)
    assert draft != neuron_config


def test_unknown_keyword_is_kept_as_a_plain_attribute() -> None:
    config = NeuronConfig(batch_sise=2, my_plugin_setting="x")
    assert config.batch_sise == 2
    assert config.my_plugin_setting == "x"
    assert config.batch_size == 1


def test_equality_covers_every_attribute() -> None:
    assert NeuronConfig() == NeuronConfig()
    assert NeuronConfig(seq_len=256) != NeuronConfig()
    assert NeuronConfig(extra=1) != NeuronConfig()
    assert NeuronConfig(extra=1) == NeuronConfig(extra=1)
    assert NeuronConfig() != MoENeuronConfig()
    copied = copy.deepcopy(NeuronConfig(on_device_sampling_config={"top_k": 3}))
    assert copied == NeuronConfig(on_device_sampling_config={"top_k": 3})


def test_deprecated_logical_neuron_cores_maps_to_logical_nc_config() -> None:
    with pytest.warns(DeprecationWarning, match="logical_nc_config"):
        config = NeuronConfig(logical_neuron_cores=2)
    assert config.logical_nc_config == 2
    assert "logical_neuron_cores" not in vars(config)
    with pytest.warns(DeprecationWarning):
        assert config.logical_neuron_cores == 2
    with pytest.warns(DeprecationWarning):
        config.logical_neuron_cores = 1
    assert config.logical_nc_config == 1


def test_logical_nc_config_without_the_alias_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert NeuronConfig(logical_nc_config=2).logical_nc_config == 2


def test_logical_nc_config_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LNC_ENV, "2")
    assert NeuronConfig().logical_nc_config == 2
    assert NeuronConfig(logical_nc_config=1).logical_nc_config == 1
    monkeypatch.setenv(LNC_ENV, "two")
    with pytest.raises(ConfigError, match=LNC_ENV):
        NeuronConfig()


def test_apply_checkpoint_dtype_respects_the_users_choice() -> None:
    chosen = NeuronConfig(torch_dtype="bfloat16")
    chosen.apply_checkpoint_dtype("float32")
    assert chosen.torch_dtype is torch.bfloat16
    default = NeuronConfig()
    default.apply_checkpoint_dtype("float32")
    assert default.torch_dtype is torch.float32
    default.apply_checkpoint_dtype("not-a-dtype")
    assert default.torch_dtype is torch.float32


SAMPLING_DEFAULTS = {
    "do_sample": False,
    "top_k": 1,
    "top_p": 1.0,
    "temperature": 1.0,
    "dynamic": False,
    "deterministic": False,
    "global_topk": 256,
}


def test_on_device_sampling_defaults() -> None:
    sampling = OnDeviceSamplingConfig()
    assert {name: getattr(sampling, name) for name in SAMPLING_DEFAULTS} == SAMPLING_DEFAULTS


def test_on_device_sampling_as_in_the_feature_guide() -> None:
    sampling = OnDeviceSamplingConfig(temperature=0.7, top_k=50, top_p=1.0)
    config = NeuronConfig(on_device_sampling_config=sampling)
    assert config.on_device_sampling_config is sampling
    assert (sampling.temperature, sampling.top_k) == (0.7, 50)


def test_sub_configs_accept_dicts() -> None:
    config = NeuronConfig(
        on_device_sampling_config={"do_sample": True, "top_k": 5},
        lora_config={"max_loras": 2, "lora_ckpt_paths": {"a": "/x"}},
    )
    assert config.on_device_sampling_config == OnDeviceSamplingConfig(do_sample=True, top_k=5)
    assert config.lora_config == LoraServingConfig(max_loras=2, lora_ckpt_paths={"a": "/x"})
    config.on_device_sampling_config = {"global_topk": 64}
    assert config.on_device_sampling_config == OnDeviceSamplingConfig(global_topk=64)


def test_sub_config_unknown_key_is_reported_with_a_hint() -> None:
    with pytest.raises(ConfigError) as excinfo:
        NeuronConfig(on_device_sampling_config={"topk": 5, "temprature": 0.5})
    message = str(excinfo.value)
    assert "on_device_sampling_config" in message
    assert "did you mean 'top_k'?" in message
    assert "did you mean 'temperature'?" in message
    assert len(excinfo.value.problems) == 2


def test_sub_config_of_the_wrong_type_is_reported() -> None:
    with pytest.raises(ConfigError, match="lora_config must be a LoraServingConfig"):
        NeuronConfig(lora_config="yes")


LORA_DEFAULTS = {
    "max_loras": 1,
    "max_cpu_loras": 100,  # NxD Inference's LoraServingConfig default
    "enable_dynamic_multi_lora": False,
    "lora_ckpt_paths": None,
    "lora_ckpt_paths_cpu": None,
    "lora_ckpt_json": None,
    "lora_memory_transpose": True,
    "lora_shard_linear_layer": True,
    "base_model_quantized": False,
}


def test_lora_serving_defaults() -> None:
    lora = LoraServingConfig()
    assert {name: getattr(lora, name) for name in LORA_DEFAULTS} == LORA_DEFAULTS


def test_moe_sub_configs_accept_dicts_or_instances() -> None:
    config = MoENeuronConfig(
        router_config={"act_fn": "sigmoid", "dtype": "bfloat16"},
        hybrid_sharding_config={"moe_tkg_ep_degree": 4},
        blockwise_matmul_config=BlockwiseMatmulConfig(block_size=256),
    )
    assert config.router_config == RouterConfig(act_fn="sigmoid", dtype=torch.bfloat16)
    assert config.hybrid_sharding_config == HybridShardingConfig(moe_tkg_ep_degree=4)
    assert config.blockwise_matmul_config.block_size == 256


def test_moe_config_classes_defaults() -> None:
    assert HybridShardingConfig() == HybridShardingConfig(
        moe_cte_tp_degree=1, moe_cte_ep_degree=1, moe_tkg_tp_degree=1, moe_tkg_ep_degree=1
    )
    fused = MoEFusedTKGConfig()
    assert fused.moe_fused_kernel_enabled is None and fused.quantized is False
    blockwise = BlockwiseMatmulConfig(blockwise_nki_autograd_cls="torch.nn:Linear")
    assert blockwise.blockwise_nki_autograd_cls is torch.nn.Linear
    experts = RoutedExpertsMLPOpsConfig(
        num_experts=8,
        hidden_size=64,
        intermediate_size=128,
        top_k=2,
        hidden_act="silu",
        glu_mlp=True,
    )
    assert (experts.glu_type, experts.bias, experts.capacity_factor) == ("glu", False, None)


def test_routed_experts_config_reports_missing_required_settings_from_a_dict() -> None:
    from nxdplug.config.sections import build_section

    with pytest.raises(ConfigError, match="num_experts"):
        build_section(RoutedExpertsMLPOpsConfig, {"hidden_size": 4}, "routed_experts")
