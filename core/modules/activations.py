"""The activation functions HF configs name in ``hidden_act``."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from nxdplug.errors import NotSupportedError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise NotSupportedError(
            f"hidden_act {name!r} is not implemented; supported: {', '.join(ACTIVATIONS)}"
        ) from None
