"""Every model plugin against HF transformers on the same tiny random checkpoint.

Greedy tokens must be identical in float32 (32+ new tokens, a batch of prompts of different
lengths) and logits must agree within the dtype's tolerance (teacher-forced on HF's tokens).
The checkpoints use initializer_range 0.15, and each test checks that the greedy path varies, so
a match is not the trivial match of a model repeating one token.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nxdplug import NeuronConfig, from_pretrained
from nxdplug.testing import LOGIT_TOLERANCES, check_accuracy, check_against_hf
from nxdplug.testing import random_prompts as prompts
from tests.shipped_models import PYCODER

NEW_TOKENS = 32


def load_pair(path, dtype: torch.dtype, **neuron_options):
    options = {"batch_size": 2, "seq_len": 96, "max_context_length": 32} | neuron_options
    app = from_pretrained(path, NeuronConfig(torch_dtype=dtype, **options))
    app.to_cpu()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return app, hf


def assert_greedy_path_varies(tokens: torch.Tensor) -> None:
    for row in tokens:
        assert len(set(row.tolist())) >= 4, f"degenerate greedy path {row.tolist()}"


def assert_token_match(app, hf, lengths=(7, 13), new_tokens=NEW_TOKENS) -> None:
    input_ids, mask = prompts(app.config.vocab_size, lengths)
    report = check_accuracy(app, hf, input_ids, mask, max_new_tokens=new_tokens)
    assert report.passed, report.summary()
    assert report.expected.shape[1] == new_tokens, "generation stopped early at an eos"
    assert_greedy_path_varies(report.actual)


ARCHITECTURES = ["llama", "mistral", "qwen2"]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_float32_greedy_tokens_match_hf(tiny_checkpoint, architecture) -> None:
    app, hf = load_pair(tiny_checkpoint(architecture), torch.float32)
    assert_token_match(app, hf)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logits_match_hf_within_dtype_tolerance(tiny_checkpoint, architecture, dtype) -> None:
    app, hf = load_pair(tiny_checkpoint(architecture), dtype)
    input_ids, mask = prompts(app.config.vocab_size, (5, 11))
    report = check_accuracy(app, hf, input_ids, mask, max_new_tokens=16, mode="logit-matching")
    assert report.passed, report.summary()
    assert report.tolerance == LOGIT_TOLERANCES[dtype]


LLAMA_VARIANTS = {
    "llama3-rope-scaling": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    },
    "linear-rope-scaling": {
        "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    },
    "explicit-head-dim": {"head_dim": 32},
    "tied-embeddings": {"tie_word_embeddings": True},
    "multi-head-attention": {"num_key_value_heads": 4},
    "multi-query-attention": {"num_key_value_heads": 1},
}


@pytest.mark.parametrize("variant", sorted(LLAMA_VARIANTS))
def test_llama_variants_match_hf(tiny_checkpoint, variant) -> None:
    app, hf = load_pair(tiny_checkpoint("llama", **LLAMA_VARIANTS[variant]), torch.float32)
    assert_token_match(app, hf)


@pytest.mark.parametrize(
    ("tp_degree", "heads", "kv_heads", "expected_kv_heads"),
    [
        (2, 4, 2, 2),  # kv heads already split evenly
        (4, 4, 2, 4),  # REPLICATE_TO_TP_DEGREE: each kv head twice
        (4, 8, 1, 4),  # multi-query replicated to every rank
        (2, 6, 3, 6),  # neither divides the other: CONVERT_TO_MHA
    ],
)
def test_gqa_layouts_for_tensor_parallel_degrees_match_hf(
    tiny_checkpoint, tp_degree, heads, kv_heads, expected_kv_heads
) -> None:
    path = tiny_checkpoint(
        "llama", hidden_size=48, num_attention_heads=heads, num_key_value_heads=kv_heads
    )
    app, hf = load_pair(path, torch.float32, tp_degree=tp_degree)
    attention = app.context_encoding_model.model.layers[0].self_attn
    assert attention.num_kv_heads == expected_kv_heads
    assert_token_match(app, hf)


def test_fused_qkv_matches_hf(tiny_checkpoint) -> None:
    app, hf = load_pair(tiny_checkpoint("qwen2"), torch.float32, fused_qkv=True)
    attention = app.context_encoding_model.model.layers[0].self_attn
    assert hasattr(attention, "qkv_proj") and not hasattr(attention, "q_proj")
    assert attention.qkv_proj.bias is not None
    assert_token_match(app, hf)


def test_mistral_sliding_window_shorter_than_the_sequence(tiny_checkpoint) -> None:
    app, hf = load_pair(tiny_checkpoint("mistral", sliding_window=8), torch.float32)
    assert app.context_encoding_model.model.layers[0].self_attn.sliding_window == 8
    assert_token_match(app, hf, lengths=(12, 20))


def test_qwen2_sliding_window_layers_follow_layer_types(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1)
    app, hf = load_pair(path, torch.float32)
    windows = [layer.self_attn.sliding_window for layer in app.context_encoding_model.model.layers]
    assert windows == [None, 6]
    assert_token_match(app, hf, lengths=(10, 16))


def test_pycoder_tiny_generates_hf_tokens_and_readable_code() -> None:
    app, hf = load_pair(PYCODER, torch.float32, seq_len=128, max_context_length=64)
    tokenizer = AutoTokenizer.from_pretrained(PYCODER, padding_side="left")
    batch = tokenizer(["def __init__(self", "import os\n"], return_tensors="pt", padding=True)
    report = check_accuracy(
        app, hf, batch.input_ids, batch.attention_mask, max_new_tokens=NEW_TOKENS
    )
    assert report.passed, report.summary()
    assert tokenizer.decode(report.actual[0]).startswith(", *args):\n        self.args = args")


def test_check_against_hf_is_one_call(tiny_checkpoint) -> None:
    report = check_against_hf(str(tiny_checkpoint("qwen2")), max_new_tokens=16)
    assert report.passed, report.summary()
    assert report.actual.shape == (2, 16)
    logits = check_against_hf(str(tiny_checkpoint("qwen2")), mode="logit-matching")
    assert logits.passed and logits.max_logit_error < 1e-4
