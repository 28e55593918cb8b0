"""A model as a pure function of its weights, its KV caches and one step's inputs.

Compiled graphs take the weights and caches as inputs (the caches are updated in place), so all
the sub-models and buckets of one model share a single copy of each.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn
from torch.func import functional_call

from nxdplug.modules.kv_cache import KVCacheManager
from nxdplug.modules.step import Phase, StepInputs, in_phase


def weight_names(model: nn.Module) -> list[str]:
    """Parameter names, each tied parameter once (under its first name)."""
    return [name for name, _ in model.named_parameters()]


def cache_names(model: nn.Module) -> list[str]:
    """The buffers of every KV-cache manager in the model (a fused draft brings its own)."""
    return [
        f"{prefix}.{name}"
        for prefix, module in model.named_modules()
        if isinstance(module, KVCacheManager)
        for name, _ in module.named_buffers()
    ]


class GraphFunction(nn.Module):
    """``forward(weights, caches, *inputs)``: the phase's step flattened
    (:meth:`StepInputs.flatten`: the core's four tensors, then the plugins' inputs named in
    ``extra_input_names``, in that order).

    The model is held outside the module's registered state, so exporting this module lifts
    no parameter or cache of its own: the weights and caches exist only as the graph's inputs
    (small computed buffers, such as rotary tables, become constants of the graph).
    """

    def __init__(
        self,
        model: nn.Module,
        phase: nn.Module | None = None,
        extra_input_names: tuple[str, ...] = (),
        phase_record: Phase | None = None,
    ) -> None:
        """``phase``: the module a phase runs (see ``ModelWrapper.phase_module``), holding
        ``model`` as its ``model`` attribute; the model itself by default. ``phase_record``:
        what ``current_phase()`` says while the graph is traced."""
        super().__init__()
        object.__setattr__(self, "model", model if phase is None else phase)
        self.extra_input_names = extra_input_names
        self.weight_names = weight_names(model)
        self.cache_names = cache_names(model)
        self.prefix = "" if phase is None or phase is model else "model."
        self.phase_record = phase_record

    def forward(
        self,
        weights: list[torch.Tensor],
        caches: list[torch.Tensor],
        *inputs: torch.Tensor,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        tensors = dict(zip(self.weight_names, weights, strict=True))
        tensors |= dict(zip(self.cache_names, caches, strict=True))
        tensors = {self.prefix + name: tensor for name, tensor in tensors.items()}
        step = StepInputs.unflatten(self.extra_input_names, inputs)
        scope = nullcontext() if self.phase_record is None else in_phase(self.phase_record)
        with scope:
            return functional_call(self.model, tensors, (step,))
