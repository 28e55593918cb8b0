"""GPT-OSS for nxdplug. Heavy imports are deferred until a name is used."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = (
    "GptOssInferenceConfig",
    "GptOssNeuronConfig",
    "NeuronGptOssAttention",
    "NeuronGptOssDecoderLayer",
    "NeuronGptOssForCausalLM",
    "NeuronGptOssModel",
)
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.modeling_gpt_oss"), name)
