"""nxdplug-gptneox against HF transformers, on tiny random GPT-NeoX checkpoints.

Run with the package installed (``pip install -e .``): nxdplug finds it through its entry point,
exactly as a user's nxdplug would.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from nxdplug_gptneox.convert import split_query_key_value
from safetensors.torch import load_file, save_file
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from nxdplug import NeuronConfig
from nxdplug.registry import get_registry
from nxdplug.testing import check_against_hf, fresh_plugin_manager, random_prompts

TINY_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    # HF's 0.02 gives near-uniform logits and greedy decoding then repeats one token.
    "initializer_range": 0.15,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """A tiny random GPT-NeoX checkpoint, saved by transformers, per set of config values."""
    built: dict[str, Path] = {}

    def build(**overrides: object) -> Path:
        key = repr(sorted(overrides.items()))
        if key not in built:
            folder = tmp_path_factory.mktemp("gpt_neox")
            with torch.random.fork_rng():
                torch.manual_seed(0)
                model = GPTNeoXForCausalLM(GPTNeoXConfig(**{**TINY_CONFIG, **overrides}))
            model.save_pretrained(folder)
            built[key] = folder
        return built[key]

    return build


def neuron_config(**options: object) -> NeuronConfig:
    return NeuronConfig(
        batch_size=2, seq_len=64, max_context_length=32, torch_dtype="float32", **options
    )


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of different lengths, left-padded."""
    return random_prompts(TINY_CONFIG["vocab_size"], (6, 15), seed=3)


def test_the_plugin_is_found_through_its_entry_point() -> None:
    with fresh_plugin_manager() as manager:
        info = manager.plugin_info("gptneox")
        record = get_registry().find_architecture(["GPTNeoXForCausalLM"], "gpt_neox")
    assert (info.distribution, info.status) == ("nxdplug-gptneox", "active")
    assert record.name == "gpt-neox"


@pytest.mark.parametrize("rotary_pct", [0.25, 1.0])
@pytest.mark.parametrize("use_parallel_residual", [True, False])
def test_greedy_tokens_match_hf(
    checkpoint: Callable[..., Path], rotary_pct: float, use_parallel_residual: bool
) -> None:
    path = checkpoint(rotary_pct=rotary_pct, use_parallel_residual=use_parallel_residual)
    input_ids, mask = prompts()
    report = check_against_hf(
        str(path),
        neuron_config(),
        prompts=input_ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
    )
    assert report.passed, report.summary()
    assert report.expected.shape == (2, NEW_TOKENS)
    # A path that varies: a continuation stuck on one token would prove little.
    assert all(len(set(row.tolist())) >= 4 for row in report.expected)


@pytest.mark.parametrize("rotary_pct", [0.25, 1.0])
def test_logits_match_hf(checkpoint: Callable[..., Path], rotary_pct: float) -> None:
    input_ids, mask = prompts()
    report = check_against_hf(
        str(checkpoint(rotary_pct=rotary_pct)),
        neuron_config(),
        prompts=input_ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        mode="logit-matching",
    )
    assert report.passed, report.summary()


def test_fused_qkv_and_tied_embeddings_match_hf(checkpoint: Callable[..., Path]) -> None:
    """nxdplug's own fused-QKV step works on the q/k/v split this plugin's converter makes."""
    path = checkpoint(tie_word_embeddings=True, use_parallel_residual=False)
    report = check_against_hf(str(path), neuron_config(fused_qkv=True), max_new_tokens=NEW_TOKENS)
    assert report.passed, report.summary()


def test_a_checkpoint_written_by_transformers_4_matches_hf(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Pythia's files: attention mask and rotary buffers, ``rotary_pct``/``rotary_emb_base``."""
    source = checkpoint(rotary_pct=0.5)
    weights = load_file(source / "model.safetensors")
    for layer in range(TINY_CONFIG["num_hidden_layers"]):
        prefix = f"gpt_neox.layers.{layer}.attention."
        weights[prefix + "bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
        weights[prefix + "masked_bias"] = torch.tensor(-1e9)
        weights[prefix + "rotary_emb.inv_freq"] = torch.ones(4)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    del config["rope_parameters"]
    config.update(rotary_pct=0.5, rotary_emb_base=1000)
    (tmp_path / "config.json").write_text(json.dumps(config))

    report = check_against_hf(str(tmp_path), neuron_config(), max_new_tokens=NEW_TOKENS)
    assert report.passed, report.summary()


def test_query_key_value_rows_are_grouped_by_head() -> None:
    heads, head_dim, hidden = 2, 3, 5
    fused = torch.arange(heads * 3 * head_dim * hidden).reshape(heads * 3 * head_dim, hidden)
    q, k, v = split_query_key_value(fused, heads)
    rows = fused.reshape(heads, 3, head_dim, hidden)
    assert torch.equal(q, torch.cat([rows[0, 0], rows[1, 0]]))
    assert torch.equal(k, torch.cat([rows[0, 1], rows[1, 1]]))
    assert torch.equal(v, torch.cat([rows[0, 2], rows[1, 2]]))
    bias_q, _, _ = split_query_key_value(fused[:, 0], heads)
    assert torch.equal(bias_q, q[:, 0])
