"""HuggingFaceGenerationAdapter against HF generate(), and the sampler plugins against HF's
logits warpers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained
from nxdplug.errors import NotSupportedError, NxdPlugError
from nxdplug.plugins.sampling.samplers import GreedySampler, MultinomialSampler
from nxdplug.registry import get_registry
from nxdplug.runtime.sampling import SamplingParams

PROMPTS = torch.tensor([[0, 0, 11, 42, 7, 99], [3, 14, 15, 92, 65, 35]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    path = tiny_checkpoint("llama", seed=3)
    app = from_pretrained(
        path, NeuronConfig(batch_size=2, seq_len=64, max_context_length=16, torch_dtype="float32")
    )
    app.to_cpu()
    return HuggingFaceGenerationAdapter(app), AutoModelForCausalLM.from_pretrained(path).eval()


def hf_generate(hf, **kwargs):
    with torch.inference_mode():
        return hf.generate(PROMPTS, attention_mask=MASK, do_sample=False, **kwargs)


def test_eos_stops_a_row_and_pads_it_like_hf(pair) -> None:
    adapter, hf = pair
    free_run = hf_generate(hf, max_new_tokens=12, pad_token_id=0, eos_token_id=None)
    eos = int(free_run[0, PROMPTS.shape[1] + 3])  # row 0's fourth new token becomes "eos"
    expected = hf_generate(hf, max_new_tokens=12, pad_token_id=1, eos_token_id=eos)
    actual = adapter.generate(
        PROMPTS, attention_mask=MASK, max_new_tokens=12, pad_token_id=1, eos_token_id=eos
    )
    assert torch.equal(actual, expected)
    assert (actual[0, PROMPTS.shape[1] + 4 :] == 1).all()


def test_generation_ends_when_every_row_is_finished(pair) -> None:
    adapter, hf = pair
    free_run = hf_generate(hf, max_new_tokens=4, pad_token_id=0, eos_token_id=None)
    eos_ids = free_run[:, -1].tolist()
    actual = adapter.generate(PROMPTS, attention_mask=MASK, max_new_tokens=20, eos_token_id=eos_ids)
    expected = hf_generate(hf, max_new_tokens=20, pad_token_id=0, eos_token_id=eos_ids)
    assert torch.equal(actual, expected)
    assert actual.shape[1] < PROMPTS.shape[1] + 20


def test_max_length_and_max_new_tokens(pair) -> None:
    adapter, hf = pair
    by_length = adapter.generate(PROMPTS, attention_mask=MASK, max_length=10, eos_token_id=None)
    assert by_length.shape == (2, 10)
    both = adapter.generate(
        PROMPTS, attention_mask=MASK, max_length=10, max_new_tokens=7, eos_token_id=None
    )
    assert both.shape == (2, PROMPTS.shape[1] + 7)
    default = adapter.generate(PROMPTS, attention_mask=MASK, eos_token_id=None)
    with torch.inference_mode():
        expected = hf.generate(PROMPTS, attention_mask=MASK, eos_token_id=None, do_sample=False)
    assert default.shape == expected.shape == (2, PROMPTS.shape[1] + 20)  # transformers 5


def test_generation_config_object_and_scores(pair) -> None:
    adapter, hf = pair
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = adapter.generate(
        PROMPTS,
        attention_mask=MASK,
        generation_config=config,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    expected = hf_generate(
        hf, generation_config=config, return_dict_in_generate=True, output_logits=True
    )
    assert torch.equal(out.sequences, expected.sequences)
    assert len(out.scores) == len(out.logits) == 6
    for ours, theirs in zip(out.logits, expected.logits, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_beams": 2}, NotSupportedError, "num_beams=2"),
        ({"guidance_scale": 1.5}, NotSupportedError, "guidance_scale=1.5"),
        ({"penalty_alpha": 0.6, "top_k": 4}, NotSupportedError, "contrastive search"),
        ({"no_such_setting": 1}, NxdPlugError, "no_such_setting"),
        ({"max_length": 4}, NxdPlugError, "leaves no room"),
    ],
)
def test_unsupported_or_unknown_settings_are_refused(pair, kwargs, error, message) -> None:
    adapter, _ = pair
    with pytest.raises(error, match=message):
        adapter.generate(PROMPTS, attention_mask=MASK, **kwargs)


def test_sampling_is_reproducible_and_top_k_1_is_greedy(pair) -> None:
    adapter, _ = pair
    common = {"attention_mask": MASK, "max_new_tokens": 10, "eos_token_id": None}
    torch.manual_seed(0)
    first = adapter.generate(PROMPTS, do_sample=True, temperature=1.5, **common)
    torch.manual_seed(0)
    second = adapter.generate(PROMPTS, do_sample=True, temperature=1.5, **common)
    assert torch.equal(first, second)
    greedy = adapter.generate(PROMPTS, **common)
    top1 = adapter.generate(PROMPTS, do_sample=True, top_k=1, **common)
    assert torch.equal(greedy, top1)
    assert not torch.equal(first, greedy), "temperature 1.5 sampling never left the greedy path"


def test_samplers_come_from_the_sampler_plugins() -> None:
    registry = get_registry()
    assert registry.get("samplers", "greedy").load("implementation") is GreedySampler
    assert registry.get("samplers", "multinomial").load("implementation") is MultinomialSampler


def hf_warped(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    scores = logits
    if params.temperature != 1.0:
        scores = TemperatureLogitsWarper(params.temperature)(None, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores


@settings(max_examples=60, deadline=None)
@given(
    top_k=st.integers(0, 40),
    top_p=st.floats(0.05, 1.0),
    temperature=st.floats(0.2, 3.0),
    seed=st.integers(0, 2**16),
)
def test_multinomial_scores_and_draws_equal_hf_warpers(top_k, top_p, temperature, seed) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 50, generator=generator) * 3
    params = SamplingParams(top_k=top_k, top_p=top_p, temperature=temperature)
    sampler = MultinomialSampler()
    expected = hf_warped(logits, params)
    assert torch.equal(sampler.scores(logits, params), expected)
    torch.manual_seed(seed)
    ours = sampler(logits, params)
    torch.manual_seed(seed)
    theirs = torch.multinomial(expected.softmax(dim=-1), num_samples=1).squeeze(1)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    "bad", [{"temperature": 0.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}]
)
def test_sampling_params_are_validated(bad) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.mark.parametrize("vocab", [32000, 1000, 200, 100, 128 * 7 + 1])
def test_the_greedy_sampler_is_torch_argmax(vocab) -> None:
    """Blockwise (maxima of 128 values first): the first index of the highest value, with ties
    inside and across blocks, -inf rows, NaN (which argmax counts as highest) and a last,
    partial block."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=generator)
    logits[1, [5, vocab - 1]] = 50.0  # a tie across blocks
    logits[2, [vocab - 1, vocab - 2]] = 50.0  # a tie in the last block
    logits[3] = float("-inf")
    logits[4, [vocab // 2, 3]] = float("nan")
    logits[5, vocab - 1] = 50.0  # the last value
    logits[6] = 1.0  # every value the same
    for dtype in (torch.float32, torch.bfloat16):
        rows = logits.to(dtype)
        assert torch.equal(GreedySampler()(rows, SamplingParams()), rows.argmax(dim=-1))
    transposed = logits.t().contiguous().t()  # the vocabulary not contiguous
    assert torch.equal(GreedySampler()(transposed, SamplingParams()), logits.argmax(dim=-1))
