"""generate() with transformers' own logits processors, stopping criteria, streamers and
num_return_sequences, against HF transformers' generate() on the same tiny checkpoint."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
    TextStreamer,
)

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained
from nxdplug.errors import NotSupportedError

PROMPTS = torch.tensor([[0, 0, 11, 42, 7, 99], [3, 14, 15, 92, 65, 35]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
START = PROMPTS.shape[1]
NEW = 16
# No end-of-sequence token unless a test gives one; 0 pads.
COMMON = {"max_new_tokens": NEW, "eos_token_id": None, "pad_token_id": 0}


def build(path, **options):
    config = NeuronConfig(
        batch_size=2, seq_len=64, max_context_length=16, torch_dtype="float32", **options
    )
    app = from_pretrained(path, config)
    app.to_cpu()
    return app


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama", seed=3)


@pytest.fixture(scope="module")
def pair(path):
    return HuggingFaceGenerationAdapter(build(path)), AutoModelForCausalLM.from_pretrained(
        path
    ).eval()


@pytest.fixture(scope="module")
def greedy(pair) -> torch.Tensor:
    adapter, _ = pair
    tokens = adapter.generate(PROMPTS, attention_mask=MASK, **COMMON)
    assert len(set(tokens[0, START:].tolist())) > 4, "the greedy path should vary"
    return tokens


def both(pair, prompts=PROMPTS, mask=MASK, seed=None, **kwargs):
    """(ours, HF's) generate() of the same call, each from ``seed`` when given."""
    adapter, hf = pair
    if seed is not None:
        torch.manual_seed(seed)
    ours = adapter.generate(prompts, attention_mask=mask, **kwargs)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.inference_mode():
        theirs = hf.generate(prompts, attention_mask=mask, **kwargs)
    return ours, theirs


def greedy_cases(greedy: torch.Tensor) -> dict[str, dict]:
    first, second = int(greedy[0, START]), int(greedy[0, START + 1])
    early_eos = int(greedy[0, START + 2])  # ends row 0 after 3 tokens when nothing holds it
    return {
        "min_new_tokens": {"eos_token_id": early_eos, "min_new_tokens": 10},
        "min_length": {"eos_token_id": early_eos, "min_length": START + 10},
        "repetition_penalty": {"repetition_penalty": 1.5},
        "encoder_repetition_penalty": {"encoder_repetition_penalty": 1.5},
        "no_repeat_ngram_size": {"no_repeat_ngram_size": 1},
        "bad_words_ids": {"bad_words_ids": [[first], [int(greedy[1, START]), 65]]},
        "suppress_tokens": {"suppress_tokens": [first, second]},
        "forced_eos_token_id": {"forced_eos_token_id": first},
        "sequence_bias": {"sequence_bias": {(second,): -100.0}},
    }


@pytest.mark.parametrize(
    "name",
    [
        "min_new_tokens",
        "min_length",
        "repetition_penalty",
        "encoder_repetition_penalty",
        "no_repeat_ngram_size",
        "bad_words_ids",
        "suppress_tokens",
        "forced_eos_token_id",
        "sequence_bias",
    ],
)
def test_greedy_processor_gives_hf_tokens(pair, greedy, name) -> None:
    kwargs = COMMON | greedy_cases(greedy)[name]
    ours, theirs = both(pair, do_sample=False, **kwargs)
    assert torch.equal(ours, theirs)
    without = {k: v for k, v in kwargs.items() if k != name}
    plain = pair[0].generate(PROMPTS, attention_mask=MASK, **without)
    assert not torch.equal(ours, plain), f"{name} changed nothing"


@pytest.mark.parametrize(
    "setting", [{"min_p": 0.2}, {"typical_p": 0.5}, {"top_k": 5, "temperature": 0.7}]
)
def test_sampling_warpers_give_hf_tokens_and_scores(pair, setting) -> None:
    kwargs = COMMON | {"do_sample": True, "top_k": 0} | setting
    dict_out = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True}
    ours, theirs = both(pair, seed=7, **kwargs, **dict_out)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert len(ours.scores) == len(theirs.scores) == NEW
    for mine, hfs in zip(ours.scores, theirs.scores, strict=True):
        assert torch.equal(torch.isinf(mine), torch.isinf(hfs))  # the same tokens kept
        kept = ~torch.isinf(hfs)
        torch.testing.assert_close(mine[kept], hfs[kept], atol=1e-4, rtol=1e-4)
    kept_counts = [int((~torch.isinf(s)).sum(-1).max()) for s in ours.scores]
    assert max(kept_counts) < ours.scores[0].shape[-1], "the warper kept every token"
    chosen = ours.sequences[:, START:]
    for step, scores in enumerate(ours.scores):  # every draw is from the kept set
        assert torch.isfinite(scores.gather(1, chosen[:, step : step + 1])).all()
    free = pair[0].generate(PROMPTS, attention_mask=MASK, **COMMON | {"do_sample": True})
    assert not torch.equal(ours.sequences, free)


def test_scores_and_logits_with_processors_equal_hf(pair) -> None:
    kwargs = COMMON | {"do_sample": False, "repetition_penalty": 1.3, "suppress_tokens": [5]}
    dict_out = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True}
    ours, theirs = both(pair, **kwargs, **dict_out)
    assert torch.equal(ours.sequences, theirs.sequences)
    for name in ("scores", "logits"):
        for mine, hfs in zip(getattr(ours, name), getattr(theirs, name), strict=True):
            assert mine.dtype == hfs.dtype == torch.float32
            torch.testing.assert_close(mine, hfs, atol=1e-4, rtol=1e-4)


class BanEvenSteps(LogitsProcessor):
    """Bans a token on steps where the sequence length is even."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] % 2 == 0:
            scores = scores.clone()
            scores[:, self.token] = -float("inf")
        return scores


class StopAfter(StoppingCriteria):
    """A row is done once it has produced ``token``."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return (input_ids[:, START:] == self.token).any(dim=1)


def test_caller_processors_and_criteria_are_merged_as_hf_does(pair, greedy) -> None:
    banned = int(greedy[0, START + 1])
    stop = int(greedy[1, START + 5])
    kwargs = COMMON | {"do_sample": False, "repetition_penalty": 1.2}
    ours, theirs = both(
        pair,
        logits_processor=LogitsProcessorList([BanEvenSteps(banned)]),
        stopping_criteria=StoppingCriteriaList([StopAfter(stop)]),
        **kwargs,
    )
    assert torch.equal(ours, theirs)
    assert ours.shape[1] < START + NEW or (ours[:, START:] == stop).any(dim=1).all()


def test_stop_strings_with_the_tokenizer(pair, path, greedy) -> None:
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.decode(greedy[1, START + 3 : START + 5])
    kwargs = COMMON | {"do_sample": False, "stop_strings": [text], "tokenizer": tokenizer}
    kwargs["eos_token_id"] = int(greedy[0, START + 6])  # row 0 ends by eos, row 1 by the string
    ours, theirs = both(pair, **kwargs)
    assert torch.equal(ours, theirs)
    assert ours.shape[1] < START + NEW
    with pytest.raises(ValueError, match="tokenizer"):
        pair[0].generate(PROMPTS, attention_mask=MASK, **COMMON | {"stop_strings": ["x"]})


def test_text_streamer_prints_what_hf_prints(pair, path, capsys) -> None:
    tokenizer = AutoTokenizer.from_pretrained(path)
    adapter, hf = pair
    kwargs = COMMON | {"do_sample": False, "max_new_tokens": 8}
    out = adapter.generate(PROMPTS[1:], streamer=TextStreamer(tokenizer), **kwargs)
    ours = capsys.readouterr().out
    with torch.inference_mode():
        hf.generate(PROMPTS[1:], streamer=TextStreamer(tokenizer), **kwargs)
    assert ours == capsys.readouterr().out
    assert ours.strip() and tokenizer.decode(out[0]).strip() in ours


@pytest.mark.filterwarnings("ignore:the model runs on thread:RuntimeWarning")  # HF's pattern
def test_text_iterator_streamer_yields_the_new_text(pair, path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(path)
    adapter, _ = pair
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    result: dict[str, torch.Tensor] = {}

    def run() -> None:
        result["out"] = adapter.generate(
            PROMPTS[1:], streamer=streamer, **COMMON | {"do_sample": False}
        )

    thread = threading.Thread(target=run)
    thread.start()
    text = "".join(streamer)
    thread.join()
    assert text == tokenizer.decode(result["out"][0, START:])


def test_num_return_sequences_samples_each_copy(pair) -> None:
    kwargs = COMMON | {"do_sample": True, "num_return_sequences": 2, "temperature": 1.5}
    ours, theirs = both(pair, prompts=PROMPTS[:1], mask=MASK[:1], seed=11, **kwargs)
    assert ours.shape == (2, START + NEW)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours[0], ours[1])
    with pytest.raises(Exception, match="batch"):  # 2 prompts x 2 copies > batch_size 2
        pair[0].generate(PROMPTS, attention_mask=MASK, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_beams": 2}, r"num_beams=2: beam search"),
        ({"dola_layers": "high"}, "DoLa"),
        ({"guidance_scale": 2.0}, "second model call"),
    ],
)
def test_other_modes_are_refused_by_name(pair, kwargs, message) -> None:
    with pytest.raises(NotSupportedError, match=message):
        pair[0].generate(PROMPTS, attention_mask=MASK, **COMMON | kwargs)


# On-device sampling and speculation --------------------------------------------------------------


def test_on_device_sampling_without_logits_refuses_host_processors(path) -> None:
    adapter = HuggingFaceGenerationAdapter(build(path, on_device_sampling_config={}))
    with pytest.raises(NotSupportedError, match=r"RepetitionPenalty.*output_logits=True"):
        adapter.generate(PROMPTS, attention_mask=MASK, repetition_penalty=1.3, **COMMON)
    # processors the graph does itself, and stopping criteria, need no logits
    adapter.generate(PROMPTS, attention_mask=MASK, stop_strings=None, **COMMON)


def test_on_device_sampling_with_logits_chooses_on_the_host(pair, path) -> None:
    adapter = HuggingFaceGenerationAdapter(
        build(path, on_device_sampling_config={}, output_logits=True)
    )
    kwargs = COMMON | {"do_sample": False, "repetition_penalty": 1.5}
    ours = adapter.generate(PROMPTS, attention_mask=MASK, **kwargs)
    assert torch.equal(ours, both(pair, **kwargs)[1])


def test_speculation_refuses_criteria_and_streamers(path, greedy) -> None:
    """Processors run at every verified position
    (tests/core/generation/test_speculation_processors.py); stopping criteria and streamers are
    refused."""
    adapter = HuggingFaceGenerationAdapter(
        build(path, speculation_length=3, trace_tokengen_model=False)
    )
    lookup = COMMON | {"prompt_lookup_num_tokens": 2}
    for extra, name in [
        ({"stopping_criteria": StoppingCriteriaList([StopAfter(1)])}, "StopAfter"),
        ({"streamer": TextStreamer(None)}, "streamer"),
    ]:
        with pytest.raises(NotSupportedError, match=f"{name}.*speculative decoding"):
            adapter.generate(PROMPTS, attention_mask=MASK, **lookup | extra)
    plain = adapter.generate(PROMPTS, attention_mask=MASK, **lookup)
    assert torch.equal(plain, greedy)
