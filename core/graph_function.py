"""A model as a pure function of its weights, its KV caches and one step's inputs.

Compiled graphs take the weights and caches as inputs (the caches are updated in place), so all
the sub-models and buckets of one model share a single copy of each.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call


def weight_names(model: nn.Module) -> list[str]:
    """Parameter names, each tied parameter once (under its first name)."""
    return [name for name, _ in model.named_parameters()]


def cache_names(model: nn.Module) -> list[str]:
    return [f"kv_mgr.{name}" for name, _ in model.kv_mgr.named_buffers()]


class GraphFunction(nn.Module):
    """``forward(weights, caches, input_ids, attention_mask, position_ids, seq_ids, *sampling)``,
    where ``sampling`` is ``(sampling_params, sampling_noise)`` with on-device sampling.

    The model is held outside the module's registered state, so exporting this module lifts
    no parameter or cache of its own: the weights and caches exist only as the graph's inputs
    (small computed buffers, such as rotary tables, become constants of the graph).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "model", model)
        self.weight_names = weight_names(model)
        self.cache_names = cache_names(model)

    def forward(
        self,
        weights: list[torch.Tensor],
        caches: list[torch.Tensor],
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor,
        *sampling: torch.Tensor,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        tensors = dict(zip(self.weight_names, weights, strict=True))
        tensors |= dict(zip(self.cache_names, caches, strict=True))
        return functional_call(
            self.model, tensors, (input_ids, attention_mask, position_ids, seq_ids, *sampling)
        )
