"""Qwen3-MoE against HF transformers on tiny random checkpoints.

The checkpoints route over 8 experts (top 2) of width moe_intermediate_size (32, not the dense
intermediate_size of 128), keep layer 1 dense (mlp_only_layers), and have q_norm / k_norm
weights drawn away from HF's initial ones. Float32 greedy tokens must be identical to HF for a
batch of prompts of different lengths, eager and compiled, with routing spread over the experts
(the expert histogram); logits within each dtype's tolerance of HF in float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nxdplug import from_pretrained
from nxdplug.config import MoENeuronConfig, NeuronConfig
from nxdplug.contrib_models.qwen3_moe import NeuronQwen3MoeForCausalLM, Qwen3MoeNeuronConfig
from nxdplug.errors import ConfigError
from nxdplug.modules.mlp import GatedMLP
from nxdplug.modules.moe import MoE
from nxdplug.testing import LOGIT_TOLERANCES, check_accuracy, derived_checkpoint
from nxdplug.testing import random_prompts as prompts
from tests.models.test_moe_models import assert_routing_spreads, record_expert_choices

SETTINGS = {"batch_size": 2, "seq_len": 96, "max_context_length": 32}
EXPERTS = 8
CHECKPOINT = {
    "num_hidden_layers": 3,
    "num_experts": EXPERTS,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],
}
NEW_TOKENS = 32


def spread_qk_norm_weights(tensors: dict[str, torch.Tensor]) -> None:
    generator = torch.Generator().manual_seed(3)
    for name, tensor in tensors.items():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            tensors[name] = 1 + 0.5 * torch.randn(tensor.shape, generator=generator)


@pytest.fixture(scope="module")
def qwen3_moe_checkpoint(tiny_checkpoint, tmp_path_factory):
    """A tiny random Qwen3-MoE checkpoint (``overrides`` change its config), once per module."""
    built: dict[str, Path] = {}

    def build(**overrides) -> Path:
        key = repr(sorted(overrides.items()))
        if key not in built:
            source = tiny_checkpoint("qwen3_moe", **(CHECKPOINT | overrides))
            output = tmp_path_factory.mktemp("qwen3_moe") / "checkpoint"
            built[key] = derived_checkpoint(source, output, edit=spread_qk_norm_weights)
        return built[key]

    return build


def load_pair(path: Path, dtype: torch.dtype, **options):
    app = from_pretrained(path, Qwen3MoeNeuronConfig(torch_dtype=dtype, **(SETTINGS | options)))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return app, hf


def assert_tokens_match(app, hf, lengths=(7, 13)) -> torch.Tensor:
    input_ids, mask = prompts(app.config.vocab_size, lengths)
    report = check_accuracy(app, hf, input_ids, mask, max_new_tokens=NEW_TOKENS)
    assert report.passed, report.summary()
    assert report.expected.shape[1] == NEW_TOKENS, "generation stopped early at an eos"
    for row in report.actual:
        assert len(set(row.tolist())) >= 4, f"degenerate greedy path {row.tolist()}"
    return report.actual


def test_float32_greedy_tokens_match_hf_with_routing_spread_over_experts(
    qwen3_moe_checkpoint,
) -> None:
    app, hf = load_pair(qwen3_moe_checkpoint(), torch.float32)
    assert isinstance(app, NeuronQwen3MoeForCausalLM)
    app.to_cpu()
    layers = app.context_encoding_model.model.layers
    assert [type(layer.mlp) for layer in layers] == [MoE, GatedMLP, MoE]
    assert layers[0].mlp.expert_mlps.down_proj.shape == (EXPERTS, 64, 32)
    assert layers[1].mlp.down_proj.weight.shape == (64, 128)
    assert app.neuron_config.normalize_top_k_affinities is True
    chosen = record_expert_choices(app)
    assert_tokens_match(app, hf)
    assert_routing_spreads(chosen, EXPERTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_match_hf_float32_within_dtype_tolerance(qwen3_moe_checkpoint, dtype) -> None:
    """Against HF in float32 (as tests/models/test_moe_models.py explains: HF's own bfloat16 run is
    no oracle once routing amplifies rounding)."""
    app, hf = load_pair(qwen3_moe_checkpoint(), dtype)
    hf = hf.float()
    app.to_cpu()
    input_ids, mask = prompts(app.config.vocab_size, (5, 11))
    report = check_accuracy(app, hf, input_ids, mask, max_new_tokens=16, mode="logit-matching")
    assert report.passed, report.summary()
    assert report.tolerance == LOGIT_TOLERANCES[dtype]


def test_compiled_greedy_tokens_match_hf(qwen3_moe_checkpoint, tmp_path) -> None:
    app, hf = load_pair(
        qwen3_moe_checkpoint(), torch.float32, compile_backend="inductor", enable_bucketing=False
    )
    app.compile(tmp_path / "compiled", quiet=True)
    app.load(tmp_path / "compiled", quiet=True)
    input_ids, mask = prompts(app.config.vocab_size, (6, 17))
    report = check_accuracy(app, hf, input_ids, mask, max_new_tokens=24)
    assert report.passed, report.summary()


def test_unnormalized_top_k_and_sparse_step_match_hf(qwen3_moe_checkpoint) -> None:
    """norm_topk_prob=False (HF's default) and every second layer sparse (decoder_sparse_step)."""
    path = qwen3_moe_checkpoint(norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[])
    app, hf = load_pair(path, torch.float32)
    app.to_cpu()
    assert app.neuron_config.normalize_top_k_affinities is False
    layers = app.context_encoding_model.model.layers
    assert [type(layer.mlp) for layer in layers] == [GatedMLP, MoE, GatedMLP]
    assert_tokens_match(app, hf)


def test_fused_expert_layout_loads_as_the_per_expert_one(qwen3_moe_checkpoint, tmp_path) -> None:
    """A checkpoint holding transformers' in-memory layout (mlp.experts.gate_up_proj) gives the
    same tokens as the per-expert one save_pretrained writes."""
    source = qwen3_moe_checkpoint()
    tensors = load_file(source / "model.safetensors")
    for layer in (0, 2):
        experts = f"model.layers.{layer}.mlp.experts"
        per_expert = {
            name: torch.stack([tensors.pop(f"{experts}.{e}.{name}.weight") for e in range(EXPERTS)])
            for name in ("gate_proj", "up_proj", "down_proj")
        }
        tensors[f"{experts}.gate_up_proj"] = torch.cat(
            [per_expert["gate_proj"], per_expert["up_proj"]], dim=1
        )
        tensors[f"{experts}.down_proj"] = per_expert["down_proj"]
    fused = derived_checkpoint(source, tmp_path / "fused")
    save_file(tensors, fused / "model.safetensors", metadata={"format": "pt"})
    app, _ = load_pair(fused, torch.float32)
    app.to_cpu()
    _, hf = load_pair(source, torch.float32)
    assert_tokens_match(app, hf)


def test_a_neuron_config_that_contradicts_the_checkpoint_is_refused(qwen3_moe_checkpoint):
    path = qwen3_moe_checkpoint()
    with pytest.raises(ConfigError, match="Qwen3-MoE needs a MoENeuronConfig"):
        from_pretrained(path, NeuronConfig(**SETTINGS))
    with pytest.raises(ConfigError, match=r"normalize_top_k_affinities=False contradicts"):
        from_pretrained(path, MoENeuronConfig(normalize_top_k_affinities=False, **SETTINGS))
    with pytest.raises(ConfigError, match=r"glu_mlp=False contradicts"):
        from_pretrained(path, Qwen3MoeNeuronConfig(glu_mlp=False, **SETTINGS))
    with pytest.raises(ConfigError, match="router takes a softmax"):
        from_pretrained(path, Qwen3MoeNeuronConfig(router_config={"act_fn": "sigmoid"}))


def test_settings_left_at_their_defaults_follow_the_checkpoint(qwen3_moe_checkpoint) -> None:
    neuron_config = MoENeuronConfig(**SETTINGS)  # normalize=True by default
    app = from_pretrained(qwen3_moe_checkpoint(norm_topk_prob=False), neuron_config)
    assert app.neuron_config.glu_mlp is True
    assert app.neuron_config.normalize_top_k_affinities is False
    assert neuron_config.normalize_top_k_affinities is True  # the caller's object is kept
    default = from_pretrained(qwen3_moe_checkpoint())
    assert isinstance(default.neuron_config, Qwen3MoeNeuronConfig)
