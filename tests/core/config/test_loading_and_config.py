"""Loading and config as NxD Inference scripts use them (issue #16).

An application built from a compiled folder alone reads the config the compile saved;
``NeuronConfig(on_cpu=True)`` is NxD Inference's CPU mode (``to_cpu()``); quantization in the
guide's order (application first, ``save_quantized_state_dict`` after); a draft given to
``generate()`` wrapped in its own HuggingFaceGenerationAdapter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained
from nxdplug.config import (
    CONFIG_FILE,
    FusedSpecNeuronConfig,
    InferenceConfig,
    LoraServingConfig,
    MoENeuronConfig,
    OnDeviceSamplingConfig,
    RouterConfig,
    core_config_problems,
    load_pretrained_config,
)
from nxdplug.contrib_models.llama.modeling_llama import (
    LlamaInferenceConfig,
    NeuronLlamaForCausalLM,
    NeuronLlamaModel,
)
from nxdplug.errors import CheckpointError, ConfigError, NotSupportedError
from nxdplug.modules.moe import initialize_moe_module
from nxdplug.pipeline import config_problems

SETTINGS = {"torch_dtype": "float32", "batch_size": 2, "seq_len": 32, "max_context_length": 16}
PROMPTS = torch.tensor([[0, 0, 5, 17, 42, 9], [8, 250, 31, 99, 7, 3]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
TINY_ATTRIBUTES = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}


def config_for(checkpoint: Path, **options) -> LlamaInferenceConfig:
    neuron_config = NeuronConfig(**(SETTINGS | options))
    return LlamaInferenceConfig(neuron_config, load_config=load_pretrained_config(checkpoint))


def greedy(app, new_tokens: int = 12, **kwargs) -> torch.Tensor:
    adapter = HuggingFaceGenerationAdapter(app)
    return adapter.generate(
        PROMPTS, attention_mask=MASK, max_new_tokens=new_tokens, eos_token_id=None, **kwargs
    )


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", seed=11)


@pytest.fixture(scope="module")
def eager_tokens(checkpoint) -> torch.Tensor:
    app = NeuronLlamaForCausalLM(checkpoint, config_for(checkpoint))
    app.to_cpu()
    return greedy(app)


@pytest.fixture(scope="module")
def compiled(checkpoint, tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """A compiled folder, and the tokens of the application that compiled it."""
    folder = tmp_path_factory.mktemp("compiled") / "llama"
    app = NeuronLlamaForCausalLM(checkpoint, config_for(checkpoint))
    app.compile(folder, quiet=True)
    app.load(folder, quiet=True)
    return folder, greedy(app)


# -- an application from the compiled folder alone ----------------------------------------------


def test_compiled_folder_alone_gives_the_config_and_the_tokens(compiled, eager_tokens) -> None:
    folder, expected = compiled
    app = NeuronLlamaForCausalLM(folder)
    assert app.config == LlamaInferenceConfig.load(folder)
    assert app.neuron_config.seq_len == 32 and app.neuron_config.torch_dtype == torch.float32
    assert app.model_path == str(folder)
    app.load(folder, quiet=True)
    assert torch.equal(greedy(app), expected)
    assert torch.equal(expected, eager_tokens)


def test_a_neuron_config_given_with_the_folder_replaces_the_saved_one(compiled) -> None:
    folder, _ = compiled
    app = NeuronLlamaForCausalLM(folder, neuron_config=NeuronConfig(**(SETTINGS | {"seq_len": 64})))
    assert app.neuron_config.seq_len == 64
    assert app.config.hidden_size == LlamaInferenceConfig.load(folder).hidden_size
    with pytest.raises(Exception, match="seq_len"):
        app.load(folder, quiet=True)


def test_a_neuron_config_given_with_a_config_replaces_its_own(checkpoint) -> None:
    replacement = NeuronConfig(**(SETTINGS | {"batch_size": 1}))
    app = NeuronLlamaForCausalLM(checkpoint, config_for(checkpoint), neuron_config=replacement)
    assert app.neuron_config is replacement and app.config.neuron_config is replacement


def test_a_checkpoint_folder_still_gives_its_hf_config(checkpoint) -> None:
    app = NeuronLlamaForCausalLM(checkpoint, neuron_config=NeuronConfig(**SETTINGS))
    assert (
        app.config.hidden_size
        == json.loads((checkpoint / "config.json").read_text())["hidden_size"]
    )
    assert not (checkpoint / CONFIG_FILE).exists()


def test_a_folder_with_neither_config_is_refused_by_name(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"config\.json"):
        NeuronLlamaForCausalLM(tmp_path)


# -- on_cpu -------------------------------------------------------------------------------------


def test_on_cpu_is_a_known_setting_kept_in_the_saved_config(checkpoint, tmp_path) -> None:
    config = config_for(checkpoint, on_cpu=True)
    assert config.neuron_config.on_cpu is True
    assert NeuronConfig().on_cpu is False
    assert config_problems(config) == []
    config.save(tmp_path)
    assert LlamaInferenceConfig.load(tmp_path).neuron_config.on_cpu is True


def test_on_cpu_runs_on_the_cpu_with_to_cpu(checkpoint, eager_tokens) -> None:
    app = NeuronLlamaForCausalLM(checkpoint, config_for(checkpoint, on_cpu=True))
    app.to_cpu()
    assert app.device == torch.device("cpu")
    assert torch.equal(greedy(app), eager_tokens)


def test_on_cpu_refuses_compile_and_load(checkpoint, compiled, tmp_path) -> None:
    folder, _ = compiled
    app = NeuronLlamaForCausalLM(checkpoint, config_for(checkpoint, on_cpu=True))
    with pytest.raises(NotSupportedError, match=r"compile\(\) with on_cpu=True.*to_cpu\(\)"):
        app.compile(tmp_path / "c", quiet=True)
    with pytest.raises(NotSupportedError, match=r"load\(\) with on_cpu=True.*to_cpu\(\)"):
        app.load(folder, quiet=True)
    assert not (tmp_path / "c").exists()


# -- quantization in the guide's order ----------------------------------------------------------


def quantized(checkpoint: Path, path: Path) -> LlamaInferenceConfig:
    options = {"quantized": True, "quantized_checkpoints_path": str(path)}
    options |= {"quantization_dtype": "int8", "quantization_type": "per_channel_symmetric"}
    return config_for(checkpoint, **options)


@pytest.mark.parametrize("missing", ["no-such-folder", "empty-folder"])
def test_missing_quantized_checkpoint_is_reported_when_weights_are_read(
    checkpoint, tmp_path, missing
) -> None:
    path = tmp_path / missing
    if missing == "empty-folder":
        path.mkdir()
    app = NeuronLlamaForCausalLM(checkpoint, quantized(checkpoint, path))  # no error yet
    with pytest.raises(CheckpointError, match="save_quantized_state_dict") as error:
        app.to_cpu()
    assert "quantized_checkpoints_path" in str(error.value) and str(path) in str(error.value)
    if missing == "no-such-folder":  # compile() looks for it before compiling the graphs
        with pytest.raises(CheckpointError, match="save_quantized_state_dict"):
            app.compile(tmp_path / "compiled", quiet=True)
        assert not (tmp_path / "compiled").exists()


def test_quantization_in_the_guides_order(checkpoint, tmp_path) -> None:
    config = quantized(checkpoint, tmp_path / "quantized")
    app = NeuronLlamaForCausalLM(checkpoint, config)
    NeuronLlamaForCausalLM.save_quantized_state_dict(checkpoint, config)
    app.to_cpu()
    assert app.loaded_model.lm_head.weight.dtype == torch.int8
    built_after = NeuronLlamaForCausalLM(checkpoint, quantized(checkpoint, tmp_path / "quantized"))
    built_after.to_cpu()
    assert torch.equal(greedy(app), greedy(built_after))


def test_quantized_checkpoints_path_is_still_required_at_construction(checkpoint) -> None:
    with pytest.raises(ConfigError, match="needs quantized_checkpoints_path"):
        NeuronLlamaForCausalLM(checkpoint, config_for(checkpoint, quantized=True))


# -- assistant_model wrapped in an adapter ------------------------------------------------------


def test_a_draft_wrapped_in_an_adapter_drafts_like_the_draft_itself(checkpoint) -> None:
    def application(**options):
        app = from_pretrained(checkpoint, NeuronConfig(**(SETTINGS | options)))
        app.to_cpu()
        return app

    target = application(speculation_length=3, trace_tokengen_model=False)
    draft = application()
    plain = greedy(draft)
    wrapped = HuggingFaceGenerationAdapter(draft)
    by_adapter = greedy(target, assistant_model=wrapped, do_sample=False)
    stats = target.speculation_stats
    assert stats.drafted > 0 and stats.accepted > 0  # the draft has the target's weights
    by_application = greedy(target, assistant_model=draft, do_sample=False)
    assert torch.equal(by_adapter, by_application)
    assert torch.equal(by_adapter, plain)


# -- sub-configs take NxD Inference's keywords --------------------------------------------------


def test_on_device_sampling_config_takes_nxd_inference_keywords() -> None:
    sampling = OnDeviceSamplingConfig(
        do_sample=True, on_device_sampling_config=True, top_k_kernel_enabled=True
    )
    assert sampling.sampling_dp_degree == 1 and sampling.top_k_kernel_enabled
    config = NeuronConfig(on_device_sampling_config={"top_k": 5, "sampling_dp_degree": 1})
    assert config.on_device_sampling_config.top_k == 5


def test_lora_serving_config_takes_nxd_inference_signature() -> None:
    lora = LoraServingConfig(
        max_loras=2,
        max_lora_rank=8,
        batch_size=4,
        lora_bias="none",
        dynamic_multi_lora=True,
        eviction_policy="lru",
        lfu_decay_period=128,
        is_context_encoding=False,
        enable_base_model_only=True,
    )
    assert lora.batch_size == 4
    assert lora.enable_dynamic_multi_lora  # NxD Inference's source name for the same switch
    assert not LoraServingConfig().enable_dynamic_multi_lora
    assert LoraServingConfig(enable_dynamic_multi_lora=True).enable_dynamic_multi_lora


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"lora_bias": "all"}, "lora_bias is 'all': adapters with bias terms are not implemented"),
        (
            {"dynamic_multi_lora": True, "enable_dynamic_multi_lora": False},
            "they are one setting",
        ),
    ],
)
def test_lora_settings_that_would_change_results_are_refused(settings, problem) -> None:
    config = InferenceConfig(NeuronConfig(lora_config=LoraServingConfig(**settings)))
    assert any(problem in p for p in core_config_problems(config))


def test_fused_spec_config_keeps_the_draft_model_cls(tmp_path) -> None:
    fused = FusedSpecNeuronConfig(
        NeuronLlamaModel, draft_model_path="/draft", draft_model_cls=NeuronLlamaForCausalLM
    )
    assert fused.draft_model_cls is NeuronLlamaForCausalLM
    assert FusedSpecNeuronConfig(NeuronLlamaModel).draft_model_cls is None
    InferenceConfig(NeuronConfig(), fused_spec_config=fused, **TINY_ATTRIBUTES).save(tmp_path)
    loaded = InferenceConfig.load(tmp_path).fused_spec_config
    assert loaded.draft_model_cls is NeuronLlamaForCausalLM


def test_router_keywords_set_the_router_the_moe_block_uses() -> None:
    neuron_config = MoENeuronConfig(router_act_fn="sigmoid", router_dtype="bfloat16")
    assert neuron_config.router_config == RouterConfig(act_fn="sigmoid", dtype=torch.bfloat16)
    assert not hasattr(neuron_config, "router_act_fn")
    config = InferenceConfig(
        neuron_config,
        num_local_experts=4,
        num_experts_per_tok=2,
        hidden_size=16,
        intermediate_size=32,
        hidden_act="silu",
    )
    router = initialize_moe_module(config).router
    assert (router.act_fn, router.dtype) == ("sigmoid", torch.bfloat16)
    assert MoENeuronConfig(router_act_fn="sigmoid").router_config.dtype == torch.float32
    assert MoENeuronConfig().router_config == RouterConfig()


def test_a_router_config_wins_over_the_router_keywords_with_a_warning() -> None:
    """As NxD Inference: the router_config dict decides; the keywords are ignored, said."""
    with pytest.warns(UserWarning, match="router_config wins"):
        config = MoENeuronConfig(
            router_act_fn="sigmoid", router_dtype="bfloat16", router_config={"act_fn": "softmax"}
        )
    assert (config.router_config.act_fn, config.router_config.dtype) == ("softmax", torch.float32)
    assert not hasattr(config, "router_act_fn")


def test_disable_normalize_top_k_affinities() -> None:
    assert MoENeuronConfig().normalize_top_k_affinities is True
    config = MoENeuronConfig(disable_normalize_top_k_affinities=True)
    assert config.normalize_top_k_affinities is False
    assert not hasattr(config, "disable_normalize_top_k_affinities")
