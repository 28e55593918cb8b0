"""Incremental detokenizing: the text released step by step is the whole output's decode, cut
at stop strings, and each step decodes a few tokens rather than the whole output so far."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from nxdplug.engine.detokenizer import IncrementalText

TEXTS = [
    "def parse(line):\n    return [int(x) for x in line.split(',')]  # naïve\n",
    "héllo wörld: ✓ — 東京 🙂🙂 déjà vu",
    "    if not x:\n        raise ValueError('empty')\n",
]


class CountingTokenizer:
    """A tokenizer that remembers the longest run of ids it was asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.longest = 0

    def decode(self, ids, **kwargs) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))


def released(tokenizer, ids, stop=()) -> tuple[str, bool]:
    text = IncrementalText(tokenizer, stop)
    pieces, stopped = [], False
    for end in range(1, len(ids) + 1):
        piece, stopped = text.update(ids[:end])
        pieces.append(piece)
        if stopped:
            break
    pieces.append(text.finish())
    return "".join(pieces), stopped


@pytest.mark.parametrize("text", TEXTS)
def test_released_pieces_add_up_to_the_whole_decode(tokenizer, text) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 5
    assert released(tokenizer, ids) == (tokenizer.decode(ids, skip_special_tokens=True), False)


def test_random_ids_with_broken_characters_add_up_too(tokenizer) -> None:
    rng = random.Random(3)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(40)]
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        assert released(tokenizer, ids) == (whole, False)


def test_a_stop_string_across_tokens_cuts_the_text(tokenizer) -> None:
    ids = tokenizer.encode(TEXTS[2], add_special_tokens=False)
    text, stopped = released(tokenizer, ids, stop=["raise Val"])
    assert stopped and text == "    if not x:\n        "


def test_each_step_decodes_a_few_tokens_not_the_whole_output(tokenizer) -> None:
    ids = tokenizer.encode(TEXTS[0] * 20, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    assert released(counting, ids)[0] == tokenizer.decode(ids)
    assert len(ids) > 300 and counting.longest <= 8
