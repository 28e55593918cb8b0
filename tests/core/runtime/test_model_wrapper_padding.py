"""ModelWrapper's NxD Inference padding API (``pad_inputs``, ``get_target_bucket``) and
``allow_input_truncation`` on a prompt longer than max_context_length."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained
from nxdplug.errors import NxdPlugError


@pytest.fixture(scope="module")
def llama_path(tiny_checkpoint):
    return tiny_checkpoint("llama")


def make_app(path, **options):
    settings = {
        "batch_size": 1,
        "seq_len": 64,
        "max_context_length": 32,
        "torch_dtype": "float32",
        "enable_bucketing": True,
        "context_encoding_buckets": [8, 16, 32],
        "token_generation_buckets": [32, 64],
    }
    app = from_pretrained(path, NeuronConfig(**(settings | options)))
    app.to_cpu()
    return app


@pytest.fixture(scope="module")
def app(llama_path):
    return make_app(llama_path)


def prompt(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.arange(5, 5 + length).unsqueeze(0)
    return ids, torch.ones_like(ids), torch.arange(length).unsqueeze(0)


def test_buckets_follow_the_strategy(app) -> None:
    cte = app.context_encoding_model
    args = prompt(10)
    assert cte.get_target_bucket(*args) == 16
    assert cte.get_target_bucket(*args, strategy="second_fit") == 32
    assert cte.get_target_bucket(*prompt(8)) == 8  # the bucket that holds it, as forward uses
    assert cte.get_target_bucket(*prompt(32), strategy="second_fit") == 32
    with pytest.raises(ValueError, match="strategy"):
        cte.get_target_bucket(*args, strategy="best_fit")


def test_context_encoding_pads_tokens_mask_and_positions(app) -> None:
    cte = app.context_encoding_model
    app.config.pad_token_id = 7
    seq_ids = torch.tensor([0])
    ids, mask, positions, rest = cte.pad_inputs(*prompt(10), seq_ids)
    assert rest is seq_ids
    assert ids.shape == mask.shape == positions.shape == (1, 16)
    assert ids[0, 10:].tolist() == [7] * 6
    assert mask[0].tolist() == [1] * 10 + [0] * 6
    assert positions[0, 10:].tolist() == [1] * 6
    assert cte.pad_inputs(*prompt(10), pad_type="max")[0].shape == (1, 32)
    assert cte.pad_inputs(*prompt(10), pad_type="second_fit")[0].shape == (1, 32)
    with pytest.raises(ValueError, match="pad_type"):
        cte.pad_inputs(*prompt(10), pad_type="min")


def test_token_generation_pads_the_mask_only(app) -> None:
    tkg = app.token_generation_model
    ids, mask, positions = (
        torch.tensor([[9]]),
        torch.ones(1, 40, dtype=torch.long),
        torch.tensor([[39]]),
    )
    out_ids, out_mask, out_positions = tkg.pad_inputs(ids, mask, positions)
    assert out_ids is ids and out_positions is positions
    assert out_mask[0].tolist() == [1] * 40 + [0] * 24


def test_too_wide_inputs_are_refused_unless_truncation_is_allowed(llama_path, app) -> None:
    with pytest.raises(ValueError, match="allow_input_truncation=True"):
        app.context_encoding_model.pad_inputs(*prompt(40), pad_type="max")
    with pytest.raises(ValueError, match="exceeds largest bucket"):
        app.context_encoding_model.pad_inputs(*prompt(40))
    cutting = make_app(llama_path, allow_input_truncation=True)
    with pytest.warns(UserWarning, match="Truncating input"):
        ids, mask, positions = cutting.context_encoding_model.pad_inputs(*prompt(40))
    assert ids[0].tolist() == list(range(5, 37))
    assert mask[0].tolist() == [1] * 32
    assert positions[0].tolist() == list(range(32))


def test_forward_cuts_a_long_prompt_only_when_allowed(llama_path, app) -> None:
    ids, mask, _ = prompt(40)
    with pytest.raises(NxdPlugError, match="allow_input_truncation"):
        app(input_ids=ids, attention_mask=mask)
    cutting = make_app(llama_path, allow_input_truncation=True)
    with pytest.warns(UserWarning, match="Truncating input"):
        logits = cutting(input_ids=ids, attention_mask=mask).logits
    hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(ids[:, :32]).logits[:, -1]
    torch.testing.assert_close(logits[:, -1], expected, atol=1e-4, rtol=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cutting(input_ids=ids[:, :20], attention_mask=mask[:, :20])  # fits: no warning


def test_generate_continues_the_cut_prompt(llama_path) -> None:
    from nxdplug import HuggingFaceGenerationAdapter

    ids, mask, _ = prompt(40)
    cutting = make_app(llama_path, allow_input_truncation=True)
    with pytest.warns(UserWarning, match="Truncating input"):
        out = HuggingFaceGenerationAdapter(cutting).generate(
            ids, attention_mask=mask, max_new_tokens=6, do_sample=False
        )
    hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    expected = hf.generate(ids[:, :32], max_new_tokens=6, do_sample=False)
    assert out.tolist() == expected.tolist()
    assert len(set(out[0, 32:].tolist())) > 1  # the greedy path varies


def test_an_eager_model_pads_prompts_to_a_width_step_not_to_the_bucket(llama_path) -> None:
    """Eager models take any width: a prompt costs its own length (rounded up to
    EAGER_PROMPT_WIDTH_STEP), not its bucket's; the tokens are still HF's."""
    app = make_app(llama_path, enable_bucketing=False, seq_len=128, max_context_length=96)
    cte = app.context_encoding_model
    assert cte.buckets == [96] and not cte.fixed_widths
    widths = []
    phase = cte.model
    original = phase.forward
    phase.forward = lambda step: widths.append(step.input_ids.shape[-1]) or original(step)
    hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    try:
        for length in (10, 40, 90):
            ids = torch.arange(5, 5 + length).unsqueeze(0)
            out = HuggingFaceGenerationAdapter(app).generate(
                ids, do_sample=False, max_new_tokens=4, eos_token_id=None
            )
            expected = hf.generate(ids, do_sample=False, max_new_tokens=4, eos_token_id=None)
            assert torch.equal(out, expected), length
    finally:
        phase.forward = original
    assert [w for w in widths if w > 1] == [32, 64, 96]  # the same module decodes too
