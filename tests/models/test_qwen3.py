"""Qwen3 (dense) and QK layer normalization against HF transformers.

The tiny checkpoints have an explicit head_dim (32, not hidden_size / heads = 16) and q_norm /
k_norm weights drawn away from HF's initial ones, so a norm that is skipped, shared wrongly or
loaded from the wrong key changes the tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained
from nxdplug.contrib_models.llama import NeuronLlamaForCausalLM
from nxdplug.contrib_models.qwen3 import NeuronQwen3ForCausalLM
from nxdplug.errors import CheckpointError
from nxdplug.pipeline import config_problems
from nxdplug.testing import (
    LOGIT_TOLERANCES,
    check_accuracy,
    derived_checkpoint,
    end_rank_process,
    hf_greedy,
    random_prompts,
)
from tests.core.modules.test_tensor_parallel import become_launched_rank, free_port
from tests.models.test_model_parity import assert_token_match, load_pair

HEAD_DIM = 32


def spread_qk_norm_weights(tensors: dict[str, torch.Tensor]) -> None:
    generator = torch.Generator().manual_seed(3)
    for name, tensor in tensors.items():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            tensors[name] = 1 + 0.5 * torch.randn(tensor.shape, generator=generator)


@pytest.fixture(scope="module")
def qwen3_checkpoint(tiny_checkpoint, tmp_path_factory):
    """A tiny random Qwen3 checkpoint (``overrides`` change its config), made once per module."""
    built: dict[str, Path] = {}

    def build(**overrides) -> Path:
        key = repr(sorted(overrides.items()))
        if key not in built:
            source = tiny_checkpoint("qwen3", **({"head_dim": HEAD_DIM} | overrides))
            output = tmp_path_factory.mktemp("qwen3") / "checkpoint"
            built[key] = derived_checkpoint(source, output, edit=spread_qk_norm_weights)
        return built[key]

    return build


def rms_norm_per_head(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., heads, head_dim] normalized over head_dim, each head on its own."""
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * weight


def test_qwen3_is_found_by_its_hf_architecture(qwen3_checkpoint) -> None:
    app = from_pretrained(qwen3_checkpoint(), NeuronConfig(batch_size=1, seq_len=32))
    assert isinstance(app, NeuronQwen3ForCausalLM)
    assert app.config.head_dim == HEAD_DIM


def test_the_norm_is_per_head_over_head_dim(qwen3_checkpoint) -> None:
    app, _ = load_pair(qwen3_checkpoint(), torch.float32)
    attention = app.context_encoding_model.model.layers[1].self_attn
    seen = {}
    for name in ("q_norm", "k_norm"):
        module = getattr(attention, name)
        module.register_forward_hook(
            lambda m, args, out, name=name: seen.update({name: (args[0], out)})
        )
    input_ids, mask = random_prompts(app.config.vocab_size, (5, 9))
    with torch.inference_mode():
        app(input_ids=input_ids, attention_mask=mask)
    for name, heads in (("q_norm", attention.num_heads), ("k_norm", attention.num_kv_heads)):
        x, out = seen[name]
        weight = getattr(attention, name).weight
        assert x.shape[-2:] == (heads, HEAD_DIM)
        assert not torch.allclose(weight, torch.ones_like(weight))
        torch.testing.assert_close(out, rms_norm_per_head(x, weight, app.config.rms_norm_eps))


def test_float32_greedy_tokens_match_hf(qwen3_checkpoint) -> None:
    app, hf = load_pair(qwen3_checkpoint(), torch.float32)
    assert_token_match(app, hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logits_match_hf_within_dtype_tolerance(qwen3_checkpoint, dtype) -> None:
    app, hf = load_pair(qwen3_checkpoint(), dtype)
    input_ids, mask = random_prompts(app.config.vocab_size, (5, 11))
    report = check_accuracy(app, hf, input_ids, mask, max_new_tokens=16, mode="logit-matching")
    assert report.passed, report.summary()
    assert report.tolerance == LOGIT_TOLERANCES[dtype]


VARIANTS = {
    "attention-bias": {"attention_bias": True},
    "tied-embeddings": {"tie_word_embeddings": True},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_match_hf(qwen3_checkpoint, variant) -> None:
    app, hf = load_pair(qwen3_checkpoint(**VARIANTS[variant]), torch.float32)
    if variant == "attention-bias":
        attention = app.context_encoding_model.model.layers[0].self_attn
        assert attention.q_proj.bias is not None and attention.o_proj.bias is not None
    assert_token_match(app, hf)


def test_sliding_window_layers_follow_layer_types(qwen3_checkpoint) -> None:
    path = qwen3_checkpoint(use_sliding_window=True, sliding_window=6, max_window_layers=1)
    app, hf = load_pair(path, torch.float32)
    windows = [layer.self_attn.sliding_window for layer in app.context_encoding_model.model.layers]
    assert windows == [None, 6]
    assert_token_match(app, hf, lengths=(10, 16))


def test_fused_qkv_with_replicated_kv_heads_matches_hf(qwen3_checkpoint) -> None:
    # tp_degree 4 with 2 K/V heads: each K/V head is replicated; the norm weights are per
    # head_dim, so every copy uses the same ones.
    app, hf = load_pair(qwen3_checkpoint(), torch.float32, tp_degree=4, fused_qkv=True)
    attention = app.context_encoding_model.model.layers[0].self_attn
    assert hasattr(attention, "qkv_proj") and attention.num_kv_heads == 4
    assert attention.k_norm.weight.shape == (HEAD_DIM,)
    assert_token_match(app, hf)


def test_compiled_greedy_tokens_match_hf(qwen3_checkpoint, tmp_path) -> None:
    path = qwen3_checkpoint()
    options = {"batch_size": 2, "seq_len": 48, "max_context_length": 16}
    app = from_pretrained(path, NeuronConfig(torch_dtype=torch.float32, **options))
    app.compile(tmp_path / "compiled", quiet=True)
    app.load(tmp_path / "compiled", quiet=True)
    assert app.backend_name == "inductor"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_token_match(app, hf, new_tokens=24)


# QK layer normalization on the Llama family, switched on by the NeuronConfig attribute.


def as_llama_checkpoint(qwen3: Path, output: Path) -> Path:
    """The Qwen3 checkpoint relabelled as Llama: the same math once qk_layernorm is set (no
    biases, no sliding windows, head_dim equal to hidden_size / heads)."""
    derived_checkpoint(qwen3, output)
    config = json.loads((output / "config.json").read_text())
    for key in ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers"):
        del config[key]
    config |= {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    (output / "config.json").write_text(json.dumps(config, indent=2))
    return output


def test_qk_layernorm_attribute_turns_the_norms_on_for_llama(qwen3_checkpoint, tmp_path) -> None:
    qwen3 = qwen3_checkpoint(head_dim=16)
    llama = as_llama_checkpoint(qwen3, tmp_path / "llama")
    options = {"batch_size": 2, "seq_len": 96, "max_context_length": 32}
    config = NeuronConfig(torch_dtype=torch.float32, qk_layernorm=True, **options)
    app = from_pretrained(llama, config)
    assert type(app) is NeuronLlamaForCausalLM
    assert not any("qk_layernorm" in p for p in config_problems(app.config))
    app.to_cpu()
    hf = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()
    assert_token_match(app, hf)


def test_qk_layernorm_without_norm_weights_names_the_missing_keys(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama")
    app = from_pretrained(path, NeuronConfig(batch_size=1, seq_len=32, qk_layernorm=True))
    with pytest.raises(CheckpointError) as error:
        app.to_cpu()
    message = str(error.value)
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    for layer in range(layers):
        for name in ("q_norm", "k_norm"):
            assert f"missing layers.{layer}.self_attn.{name}.weight" in message


# Tensor parallelism over two processes: each rank normalizes its own heads.

TP_SETTINGS = {
    "torch_dtype": "float32",
    "batch_size": 2,
    "seq_len": 48,
    "max_context_length": 16,
    "tp_degree": 2,
    "fused_qkv": True,
}
TP_NEW_TOKENS = 20


def _tp_rank(rank: int, world: int, port: int, checkpoint: str, out: str) -> None:
    become_launched_rank(rank, world, port)
    import torch.distributed as dist

    try:
        app = from_pretrained(checkpoint, NeuronConfig(**TP_SETTINGS))
        app.to_cpu()
        prompts, mask = random_prompts(app.config.vocab_size, (6, 11))
        tokens = HuggingFaceGenerationAdapter(app).generate(
            prompts, attention_mask=mask, max_new_tokens=TP_NEW_TOKENS, eos_token_id=None
        )
        attention = app.context_encoding_model.model.layers[0].self_attn
        torch.save((tokens, attention.num_heads), Path(out) / f"rank{rank}.pt")
        end_rank_process()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_generate_hf_greedy_tokens(qwen3_checkpoint, tmp_path) -> None:
    checkpoint = qwen3_checkpoint()
    mp.spawn(_tp_rank, args=(2, free_port(), str(checkpoint), str(tmp_path)), nprocs=2)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts, mask = random_prompts(hf.config.vocab_size, (6, 11))
    expected = hf_greedy(hf, prompts, mask, TP_NEW_TOKENS).sequences
    assert len(set(expected[:, prompts.shape[1] :].flatten().tolist())) > 3
    for rank in range(2):
        tokens, heads = torch.load(tmp_path / f"rank{rank}.pt")
        assert heads == 2  # half of the 4 query heads
        assert torch.equal(tokens, expected), rank
