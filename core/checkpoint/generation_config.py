"""The generation settings a checkpoint folder carries: what ``generate()`` and the serving
engine start from (end-of-sequence tokens, HF's sampling defaults)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import GenerationConfig


def model_generation_config(model: Any) -> GenerationConfig:
    """The checkpoint's ``generation_config.json``, else one with the config's special tokens.

    ``model`` is an application: its ``model_path`` and ``config``."""
    folder = Path(model.model_path)
    if (folder / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(str(folder))
    tokens = {
        name: getattr(model.config, name, None)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id")
    }
    return GenerationConfig(**{k: v for k, v in tokens.items() if v is not None})
