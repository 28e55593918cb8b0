"""A byte-level BPE tokenizer trained in-process, so tiny checkpoints need no download.

The corpus is Python source read from standard-library modules: it is on every machine, and the
tokenizer it gives encodes code prompts in few tokens. Training is deterministic for a given
Python installation, so the same vocabulary size always gives the same ``tokenizer.json``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nxdplug.plugin_api import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
"""The one special token, id 0, used as bos, eos and pad (as in GPT-2)."""

SPECIAL_TOKENS = (END_OF_TEXT,)
BYTE_ALPHABET_SIZE = 256
MIN_VOCAB_SIZE = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)

CORPUS_MODULES = (
    "argparse",
    "textwrap",
    "dataclasses",
    "functools",
    "string",
    "enum",
    "shutil",
    "inspect",
    "typing",
    "collections",
)
"""Pure-Python standard-library modules whose source is the training corpus."""

MAX_CORPUS_CHARS = 400_000
"""Bounds training time (well under a second) while leaving merges for a few thousand tokens."""


def corpus_lines() -> Iterator[str]:
    """The training text, line by line, at most :data:`MAX_CORPUS_CHARS` characters."""
    budget = MAX_CORPUS_CHARS
    for module in CORPUS_MODULES:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue  # a trimmed-down Python without this module's source
        source = Path(spec.origin).read_text(encoding="utf-8")
        for line in source.splitlines(keepends=True):
            if budget <= 0:
                return
            yield line
            budget -= len(line)


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most ``vocab_size`` tokens; ``<|endoftext|>`` is id 0.

    Every byte has a token, so any text encodes and decodes back exactly. A vocabulary larger
    than the corpus can fill stops short of ``vocab_size`` (a few thousand tokens); models may
    have more embedding rows than the tokenizer has tokens, as many released checkpoints do.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(
            [
                f"vocab_size={vocab_size} is too small for a byte-level tokenizer: it needs "
                f"{BYTE_ALPHABET_SIZE} byte tokens plus {len(SPECIAL_TOKENS)} special token(s); "
                f"use vocab_size >= {MIN_VOCAB_SIZE}"
            ]
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer)
    return tokenizer


def build_tokenizer(
    output_dir: str | os.PathLike[str],
    vocab_size: int,
    *,
    model_max_length: int | None = None,
) -> PreTrainedTokenizerFast:
    """Train a tokenizer and save it so ``AutoTokenizer.from_pretrained(output_dir)`` loads it.

    Writes ``tokenizer.json`` and ``tokenizer_config.json``. Encoding adds no special tokens;
    ``<|endoftext|>`` (id 0) is the bos, eos and pad token.
    """
    from transformers import PreTrainedTokenizerFast

    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab_size),
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        clean_up_tokenization_spaces=False,  # decode(encode(text)) must give text back
        **extra,
    )
    tokenizer.save_pretrained(os.fspath(output_dir))
    return tokenizer
