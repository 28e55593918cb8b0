"""The contracts between the models, generation and sampler plugins.

Host samplers: a sampler plugin's implementation is a class built with no arguments; its
instances map [batch, vocab] logits and :class:`SamplingParams` to scores (what HF calls
processed scores) and to [batch] token ids.

On-device sampling: a plugin enabled by ``on_device_sampling_config`` sets the model's
``sampler`` (an :class:`OnDeviceSampler`). The compiled graphs then take two more inputs after
``seq_ids``, both built on the host by the sampler's ``prepare``:

- ``sampling_params`` [batch, 3] float32: one row ``(top_k, top_p, temperature)`` per request,
  the layout of NxD Inference's dynamic sampling (:func:`sampling_params_tensor` builds it);
- ``sampling_noise`` [batch, global_topk] float32: uniform random numbers in [0, 1), the
  randomness of the draw, so that the graph itself is deterministic.
"""

from __future__ import annotations

from typing import Any, Protocol

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


def sampling_params_tensor(
    batch_size: int, top_k: float, top_p: float, temperature: float
) -> torch.Tensor:
    """The ``sampling_params`` of ``batch_size`` requests with the same settings, [batch, 3]."""
    return torch.tensor([[top_k, top_p, temperature]], dtype=torch.float32).repeat(batch_size, 1)


def example_sampling_inputs(
    batch_size: int, sampling_config: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sampling_params, sampling_noise)`` of the graphs' shapes, for tracing."""
    params = sampling_params_tensor(batch_size, 1, 1.0, 1.0)
    noise = torch.full((batch_size, sampling_config.global_topk), 0.5)
    return params, noise


class OnDeviceSampler(Protocol):
    """What a model's ``sampler`` provides: its graph inputs made on the host, and the draw."""

    def prepare(
        self, batch_size: int, sampling_params: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sampling_params, sampling_noise)`` for one step: the caller's rows, checked, or
        the config's settings when it gives none; fresh noise from the sampler's generator."""

    def reset(self) -> None:
        """Reseed the generator (a new generation starts)."""

    def __call__(
        self, logits: torch.Tensor, sampling_params: torch.Tensor, sampling_noise: torch.Tensor
    ) -> torch.Tensor:
        """[batch, vocab] logits -> [batch] token ids; runs inside the graph."""
