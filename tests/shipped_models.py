"""The trained models and held-out prompts shipped in examples/models/ (its README says how
they were made), so that the tests that need a real model need nothing beside the checkout."""

from __future__ import annotations

import json
from pathlib import Path

MODELS = Path(__file__).resolve().parents[1] / "examples" / "models"
PYCODER = MODELS / "pycoder-tiny"
PYCODER_DRAFT = MODELS / "pycoder-draft"
PYCODER_EAGLE = MODELS / "pycoder-tiny-eagle"
PYCODER_EAGLE3 = MODELS / "pycoder-tiny-eagle3"
PYCODER_MEDUSA = MODELS / "pycoder-tiny-medusa"
PROMPTS = MODELS / "prompts.jsonl"


def held_out_prompts() -> list[list[int]]:
    """The token ids of the 50 held-out prompts (64 tokens each), in the file's order."""
    return [json.loads(line)["input_ids"] for line in PROMPTS.read_text().splitlines()]


def file_start_prompts(count: int) -> list[list[int]]:
    """The first ``count`` ``file_start`` prompts: the first 64 tokens of held-out files."""
    records = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    return [r["input_ids"] for r in records if r["kind"] == "file_start"][:count]
