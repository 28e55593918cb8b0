"""The cap itself: ``cap * tanh(logits / cap)`` applied to the output of a model's head."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """Squash ``logits`` smoothly into (-cap, cap), computed in float32 whatever their dtype."""
    return (cap * torch.tanh(logits.float() / cap)).to(logits.dtype)


class LogitSoftcap:
    """A forward hook that replaces a module's output by its soft-capped value.

    A hook rather than a wrapper module: the head keeps its parameter names (``lm_head.weight``),
    which checkpoint loading and the compiled graphs (weights passed by name) rely on. It is
    plain Python around the module call, so eager runs and ``torch.export`` both see it.
    """

    def __init__(self, cap: float) -> None:
        self.cap = float(cap)

    def __call__(
        self, module: nn.Module, inputs: tuple[object, ...], output: torch.Tensor
    ) -> torch.Tensor:
        return softcap(output, self.cap)

    def __repr__(self) -> str:
        return f"LogitSoftcap(cap={self.cap})"


def add_softcap(head: nn.Module, cap: float) -> RemovableHandle:
    """Soft-cap every output of ``head`` from now on."""
    return head.register_forward_hook(LogitSoftcap(cap))
