"""Torch dtypes in configs: accepted as ``torch.float16``, ``"float16"`` or ``"torch.float16"``.

Configs store a :class:`torch.dtype` and write its short name (``"float16"``) to JSON, as NxD
Inference does, so a saved config reads back to the same dtype.
"""

from __future__ import annotations

from typing import Any

import torch


def to_torch_dtype(value: Any) -> Any:
    """The :class:`torch.dtype` that ``value`` names; anything else is returned unchanged.

    A name that is not a torch dtype is kept as given, so that validation can report it together
    with every other problem instead of failing on the first one.
    """
    if isinstance(value, str):
        candidate = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(candidate, torch.dtype):
            return candidate
    return value


def optional_torch_dtype(value: Any) -> Any:
    """Like :func:`to_torch_dtype`, with ``None`` meaning "not set"."""
    return None if value is None else to_torch_dtype(value)


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of ``dtype``: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")
