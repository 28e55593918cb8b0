"""The contract between generation and the sampler plugins.

A sampler plugin's implementation is a class built with no arguments; its instances map
[batch, vocab] logits and :class:`SamplingParams` to scores (what HF calls processed scores) and
to [batch] token ids.
"""

from __future__ import annotations

from typing import Protocol

import attrs
import torch


@attrs.frozen
class SamplingParams:
    """Per-request settings; ``top_k`` 0 and ``top_p`` 1.0 switch those filters off."""

    top_k: int = 0
    top_p: float = 1.0
    temperature: float = 1.0

    def __attrs_post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


class TokenSampler(Protocol):
    def scores(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The scores the choice is made from."""

    def __call__(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The chosen token of each row."""
