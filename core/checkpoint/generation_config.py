"""The generation settings a checkpoint folder carries: what ``generate()`` and the serving
engine start from (end-of-sequence tokens, HF's sampling defaults)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from transformers import GenerationConfig

if TYPE_CHECKING:
    from nxdplug.runtime.application import NeuronApplicationBase


def model_generation_config(model: NeuronApplicationBase) -> GenerationConfig:
    """The checkpoint's ``generation_config.json``, else one with the config's special tokens."""
    folder = Path(model.model_path)
    if (folder / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(str(folder))
    tokens = {
        name: getattr(model.config, name, None)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id")
    }
    return GenerationConfig(**{k: v for k, v in tokens.items() if v is not None})
