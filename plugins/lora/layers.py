"""LoRA in the graph: each target projection adds its rows' adapters as two batched matmuls.

``y = base(x) + (x @ A[slot]^T) @ B[slot]^T * scale[slot]``, ``slot`` being the row's entry of
the step's ``adapter_ids``; slot 0 holds zeros, so a row without an adapter gets the base
projection exactly. The stacked A and B are parameters of the projection, filled from the
adapters by the ``lora-adapters`` state-dict converter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from nxdplug.errors import NxdPlugError
from nxdplug.plugins.lora.adapters import is_target, slot_count, targets
from nxdplug.plugins.lora.store import AdapterStore
from nxdplug.runtime.step import current_step


def lora_delta(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> Any:
    """A forward hook of a target projection: its output plus each row's adapter term."""
    x = inputs[0]
    chosen = current_step()["adapter_ids"]
    a = module.lora_a[chosen]  # [batch, rank, in]
    b = module.lora_b[chosen]  # [batch, out, rank]
    delta = torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))
    return output + (delta * module.lora_scale[chosen][:, None, None]).to(output.dtype)


def add_lora_weights(model: nn.Module, context: Any) -> None:
    """The ``transform_model`` callback: stacked LoRA weights and the hook on every target."""
    config = context.config
    names = targets(config)
    count, rank = slot_count(config), config.neuron_config.lora_config.max_lora_rank
    for name, module in model.named_modules():
        if not is_target(name, names):
            continue
        module.lora_a = nn.Parameter(torch.zeros(count, rank, module.in_features))
        module.lora_b = nn.Parameter(torch.zeros(count, module.out_features, rank))
        module.lora_scale = nn.Parameter(torch.zeros(count))
        module.register_forward_hook(lora_delta)


class AdapterSlots:
    """The host side of ``adapter_ids``: one entry per row, an adapter id or None for the base
    model (or, as a tensor, the slots themselves: 0 for the base model). With dynamic
    multi-LoRA, ids not in a slot are brought in (see :mod:`nxdplug.plugins.lora.store`)."""

    def __init__(self, config: Any) -> None:
        self.store = AdapterStore(config)

    def bind(self, application: Any) -> None:
        self.store.bind(application.weight_tensors())

    def example(self, batch_size: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {"adapter_ids": torch.zeros(batch_size, dtype=torch.long, device=device)}

    def build(
        self, batch_size: int, keywords: Mapping[str, Any], device: torch.device
    ) -> dict[str, torch.Tensor]:
        given = keywords.get("adapter_ids")
        if given is None:
            return self.example(batch_size, device)
        chosen = self._slots_of(given)
        if chosen.shape != (batch_size,):
            raise NxdPlugError(
                f"adapter_ids has {len(chosen)} entries for {batch_size} rows; give one per row "
                "(None for the base model)"
            )
        return {"adapter_ids": chosen.to(device)}

    def _slots_of(self, given: Any) -> torch.Tensor:
        if isinstance(given, torch.Tensor):
            chosen = given.long().flatten()
            last = self.store.max_slots
            bad = [int(s) for s in chosen if not 0 <= int(s) <= last]
            if bad:
                raise NxdPlugError(
                    f"adapter_ids slots {bad} do not exist: 0 is the base model, 1...{last} "
                    "the adapter slots"
                )
            return chosen
        if isinstance(given, str) or not isinstance(given, Sequence):
            raise NxdPlugError("adapter_ids must be a list with an adapter id (or None) per row")
        return self.store.slots_for(given)

    def reset(self) -> None:
        """Nothing carries over between generations (the slots stay as they are)."""
