"""The pipeline: a config selects records; their callbacks run for those records only."""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from nxdplug import NeuronConfig, from_pretrained, hookimpl
from nxdplug.config import InferenceConfig, load_pretrained_config
from nxdplug.errors import ConfigError, UnknownNameError
from nxdplug.pipeline import PipelineContext, config_problems, select_plugins, validate
from nxdplug.runtime.model_wrapper import ModelWrapper
from nxdplug.testing import fresh_plugin_manager, temporary_plugin
from nxdplug.types import (
    CompileBackend,
    Feature,
    KVCacheStrategy,
    QuantizationMethod,
    SpeculationMode,
)


def check_logit_scale(context):
    if context.neuron_config.logit_scale <= 0:
        yield "logit_scale must be positive"


def zero_the_norm(model, context):
    with torch.no_grad():
        model.norm.weight.mul_(0)  # lets the test see that the transform ran before loading


def add_logit_scale_model(context):
    yield ModelWrapper(context.config, context.model_cls, tag="logit_scale_model")


class LogitScaleFeature:
    """A third-party feature with its own setting, a check, a model transform and a sub-model."""

    @hookimpl
    def nxdplug_features(self):
        yield Feature(
            name="logit-scale",
            enabled_by=("logit_scale",),
            settings={"logit_scale": None},
            conflicts_with=("fused-qkv",),
            validate=f"{__name__}:check_logit_scale",
            transform_model=f"{__name__}:zero_the_norm",
            add_submodels=f"{__name__}:add_logit_scale_model",
        )


def counted(name: str, function: Callable[..., Any], calls: Counter[str]) -> Callable[..., Any]:
    def count(*args: Any) -> Any:
        calls[name] += 1
        return function(*args)

    return count


@pytest.fixture
def callback_calls(monkeypatch) -> Counter[str]:
    """How often each of logit-scale's callbacks ran during the test."""
    calls: Counter[str] = Counter()
    module = sys.modules[__name__]
    for name in ("check_logit_scale", "zero_the_norm"):
        monkeypatch.setattr(module, name, counted(name, getattr(module, name), calls))
    return calls


@pytest.fixture
def llama_config(tiny_checkpoint):
    path = tiny_checkpoint("llama")

    def build(**options):
        base = {"torch_dtype": "float32", "seq_len": 64}
        return path, InferenceConfig(
            NeuronConfig(**(base | options)), load_config=load_pretrained_config(path)
        )

    return build


def test_default_selection(plugin_manager, llama_config) -> None:
    _, config = llama_config()
    selection = select_plugins(config)
    assert selection.architecture.name == "llama"
    assert selection.kv_cache_strategy.name == "static"
    assert selection.compile_backend.name == "eager"
    assert [c.name for c in selection.converters] == ["llama-hf", "gqa-replication"]
    assert selection.features == ()
    assert selection.plugins == {"llama", "static_kv_cache", "eager_backend", "gqa"}


def test_attributes_switch_features_and_converters_on(plugin_manager, llama_config) -> None:
    _, config = llama_config(fused_qkv=True)
    selection = select_plugins(config)
    assert [f.name for f in selection.features] == ["fused-qkv"]
    assert [c.name for c in selection.converters][-1] == "fused-qkv"
    assert "fused_qkv" in selection.plugins


def test_callbacks_run_only_for_enabled_records(
    plugin_manager, llama_config, callback_calls
) -> None:
    with temporary_plugin(LogitScaleFeature(), "logit-scale-plugin"):
        path, config = llama_config()
        assert config_problems(config) == []
        app = from_pretrained(path, config=config)
        app.to_cpu()
        assert callback_calls == {}
        assert [w.tag for w in app.models] == ["context_encoding_model", "token_generation_model"]

        path, config = llama_config(logit_scale=2.0)
        app = from_pretrained(path, config=config)
        assert callback_calls == {"check_logit_scale": 1}
        assert app.models[-1].tag == "logit_scale_model"
        app.to_cpu()
        assert callback_calls == {"check_logit_scale": 1, "zero_the_norm": 1}
        # the checkpoint's norm weights were loaded after the transform zeroed them
        assert app.context_encoding_model.model.norm.weight.abs().sum() > 0


def test_all_problems_are_reported_at_once(plugin_manager, llama_config) -> None:
    with temporary_plugin(LogitScaleFeature(), "logit-scale-plugin"):
        _, config = llama_config(logit_scale=-1.0, fused_qkv=True, batch_size=0, paddng_side="left")
        with pytest.raises(ConfigError) as error:
            validate(config)
    problems = error.value.problems
    assert any("batch_size is 0" in p for p in problems)
    assert any("logit_scale must be positive" in p for p in problems)
    assert any("'logit-scale' cannot be combined with 'fused-qkv'" in p for p in problems)
    assert any("'paddng_side'" in p and "padding_side" in p for p in problems)


def test_feature_settings_are_not_unknown_attributes(plugin_manager, llama_config) -> None:
    _, config = llama_config(logit_scale=1.0)
    assert any("'logit_scale'" in p for p in config_problems(config))
    with temporary_plugin(LogitScaleFeature(), "logit-scale-plugin"):
        assert config_problems(config) == []


def test_required_feature_that_is_missing(plugin_manager, llama_config) -> None:
    class NeedsSpeculation:
        @hookimpl
        def nxdplug_features(self):
            yield Feature(name="tree-attention", enabled_by=("fused_qkv",), requires=("eagle",))

    _, config = llama_config(fused_qkv=True)
    with temporary_plugin(NeedsSpeculation(), "needs"):
        assert "feature 'tree-attention' requires 'eagle', which is not installed" in (
            config_problems(config)
        )


def test_backend_limits_tp_degrees(plugin_manager, llama_config) -> None:
    class SmallBackend:
        @hookimpl
        def nxdplug_compile_backends(self):
            yield CompileBackend(name="small", implementation="x.y:Z", tp_degrees=(1, 2))

    _, config = llama_config(compile_backend="small", tp_degree=4)
    with temporary_plugin(SmallBackend(), "small-backend"):
        assert config_problems(config) == [
            "tp_degree=4 is not supported by the 'small' backend; supported: [1, 2]"
        ]


def test_unknown_backend_name_lists_the_choices(plugin_manager, llama_config) -> None:
    _, config = llama_config(compile_backend="tpu")
    (problem,) = config_problems(config)
    assert "unknown compile backend 'tpu'" in problem and "'eager'" in problem


def test_two_kv_cache_strategies_switched_on_is_a_conflict(plugin_manager, llama_config) -> None:
    class TwoCaches:
        @hookimpl
        def nxdplug_kv_cache_strategies(self):
            yield KVCacheStrategy(name="a", implementation="x.y:A", enabled_by=("fused_qkv",))
            yield KVCacheStrategy(name="b", implementation="x.y:B", enabled_by=("fused_qkv",))

    _, config = llama_config(fused_qkv=True)
    with temporary_plugin(TwoCaches(), "two-caches"):
        (problem,) = config_problems(config)
    assert "more than one KV-cache strategy" in problem


def test_neuron_settings_are_reported_as_without_effect_on_the_eager_backend(
    plugin_manager, llama_config
) -> None:
    _, config = llama_config(
        mlp_kernel_enabled=True, torch_dtype="bfloat16", cc_pipeline_tiling_factor=4
    )
    with pytest.warns(RuntimeWarning, match="no effect on the 'eager' backend") as caught:
        assert config_problems(config) == []
    (warning,) = caught
    assert str(warning.message).startswith(
        "cc_pipeline_tiling_factor (read by the 'neuron' backend), mlp_kernel_enabled (read by "
        "the 'neuron' backend): "
    )


def test_strict_config_makes_settings_without_effect_an_error(
    plugin_manager, llama_config, monkeypatch
) -> None:
    monkeypatch.setenv("NXDPLUG_STRICT_CONFIG", "1")
    _, config = llama_config(cc_pipeline_tiling_factor=4)
    (problem,) = config_problems(config)
    assert problem.startswith("cc_pipeline_tiling_factor (read by the 'neuron' backend): no effect")
    assert "NXDPLUG_STRICT_CONFIG=1 makes this an error" in problem


def test_default_neuron_settings_are_not_reported(plugin_manager, llama_config) -> None:
    _, config = llama_config()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config_problems(config) == []


def test_kernel_requirements_are_checked_on_every_backend(plugin_manager, llama_config) -> None:
    _, config = llama_config(qkv_kernel_enabled=True, torch_dtype="bfloat16")
    with pytest.warns(RuntimeWarning):
        problems = config_problems(config)
    assert any("qkv_kernel_enabled needs fused_qkv=True" in p for p in problems)


class HalfPrecisionQuantizer:
    """A test quantization method: float16 copies of 2-D weights."""

    def quantize_state_dict(self, state_dict, config):
        return {k: v.half() if v.dim() == 2 else v for k, v in state_dict.items()}


class QuantAndSpeculationPlugin:
    @hookimpl
    def nxdplug_quantization_methods(self):
        yield QuantizationMethod(
            name="int8-per_channel",
            dtype="int8",
            granularity="per_channel",
            implementation=f"{__name__}:HalfPrecisionQuantizer",
        )

    @hookimpl
    def nxdplug_speculation_modes(self):
        yield SpeculationMode(name="medusa", implementation="x.y:Medusa", enabled_by=("is_medusa",))


# The built-in speculation plugins, denied where a test needs speculation without them.
SPECULATION_PLUGINS = frozenset({"draft_speculation", "medusa", "eagle"})


@pytest.mark.parametrize(
    ("options", "attribute"),
    [
        ({"is_medusa": True}, "is_medusa"),
        ({"flash_decoding_enabled": True}, "flash_decoding_enabled"),
        ({"draft_model_modules_to_not_convert": ["lm_head"]}, "draft_model_modules_to_not_convert"),
        ({"speculation_length": 4, "trace_tokengen_model": False}, "speculation_length"),
    ],
)
def test_attributes_without_an_installed_plugin_are_problems(
    llama_config, options, attribute
) -> None:
    _, config = llama_config(**options)
    with fresh_plugin_manager(deny=SPECULATION_PLUGINS | {"flash_decoding"}):
        problems = config_problems(config)
    assert any(
        p.startswith(f"{attribute}=") and "no installed plugin implements it" in p for p in problems
    )


def test_trace_tokengen_model_false_needs_speculation(plugin_manager, llama_config) -> None:
    _, config = llama_config(trace_tokengen_model=False)
    assert any("leaves no sub-model to generate tokens" in p for p in config_problems(config))


def test_speculation_mode_selected_by_its_attribute(llama_config) -> None:
    _, config = llama_config(
        is_medusa=True, num_medusa_heads=4, medusa_speculation_length=4, trace_tokengen_model=False
    )
    with (
        fresh_plugin_manager(deny=SPECULATION_PLUGINS),
        temporary_plugin(QuantAndSpeculationPlugin(), "quant-spec"),
    ):
        assert config_problems(config) == []
        selection = select_plugins(config)
    assert selection.speculation_mode.name == "medusa"
    assert "quant-spec" in selection.plugins


def test_quantized_state_dict_uses_the_named_method(llama_config, tmp_path):
    """The generic path through a quantization_methods record, with the built-in quantization
    plugin denied so that a test plugin can provide the method."""
    from nxdplug.checkpoint.state_dict import load_state_dict
    from nxdplug.contrib_models.llama.modeling_llama import NeuronLlamaForCausalLM
    from nxdplug.testing import fresh_plugin_manager

    with fresh_plugin_manager(deny=frozenset({"quantization"})):
        check_quantization_method_path(llama_config, tmp_path, NeuronLlamaForCausalLM)
        saved = load_state_dict(tmp_path / "quantized")
    assert saved["model.layers.0.mlp.up_proj.weight"].dtype == torch.float16
    assert saved["model.norm.weight"].dtype == torch.float32


def check_quantization_method_path(llama_config, tmp_path, application) -> None:
    path, config = llama_config(
        quantization_dtype="int8",
        quantization_type="per_channel_symmetric",
        quantized_checkpoints_path=str(tmp_path / "quantized"),
    )
    with pytest.raises(UnknownNameError, match="quantization method 'int8-per_channel'"):
        application.save_quantized_state_dict(path, config)
    with temporary_plugin(QuantAndSpeculationPlugin(), "quant-spec"):
        application.save_quantized_state_dict(path, config)


def check_threshold(context):
    if context.neuron_config.threshold <= 0:
        yield "threshold must be positive"


def test_feature_enabled_when_set_sees_a_zero(plugin_manager, llama_config) -> None:
    class Threshold:
        @hookimpl
        def nxdplug_features(self):
            yield Feature(
                name="threshold",
                enabled_by=("threshold",),
                enabled_when_set=True,
                settings={"threshold": None},
                validate=f"{__name__}:check_threshold",
            )

    with temporary_plugin(Threshold(), "threshold-plugin"):
        _, unset = llama_config()
        assert config_problems(unset) == []
        _, zero = llama_config(threshold=0)
        assert [f.name for f in select_plugins(zero).features] == ["threshold"]
        assert config_problems(zero) == ["threshold must be positive"]


def tokens_from_the_graph(context, generation_config, batch_size, step_keywords, generate_kwargs):
    return f"{batch_size} rows sampled in the graph"


class GraphSamplers:
    """Two features whose models would sample in their graphs."""

    @hookimpl
    def nxdplug_features(self):
        for letter in "ab":
            yield Feature(
                name=f"graph-sampler-{letter}",
                enabled_by=(f"graph_sampler_{letter}",),
                settings={f"graph_sampler_{letter}": False},
                token_source=f"{__name__}:tokens_from_the_graph",
            )


def test_the_enabled_feature_gives_the_token_source(plugin_manager, llama_config) -> None:
    with temporary_plugin(GraphSamplers(), "graph-samplers"):
        _, config = llama_config()
        context = PipelineContext(config, validate(config))
        assert context.token_source(None, 2, {}, {}) is None
        _, config = llama_config(graph_sampler_b=True)
        context = PipelineContext(config, validate(config))
        assert context.token_source(None, 2, {}, {}) == "2 rows sampled in the graph"
        assert context.request_sampling() is None


def test_two_features_giving_a_token_source_are_refused_by_name(
    plugin_manager, llama_config
) -> None:
    with temporary_plugin(GraphSamplers(), "graph-samplers"):
        _, config = llama_config(graph_sampler_a=True, graph_sampler_b=True)
        with pytest.raises(ConfigError) as error:
            validate(config)
    assert error.value.problems == [
        "the config enables more than one feature that gives token_source: 'graph-sampler-a' "
        "(enabled by graph_sampler_a), 'graph-sampler-b' (enabled by graph_sampler_b); enable one"
    ]
