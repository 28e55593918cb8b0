"""LoRA in the graph: each target projection adds its rows' adapters as two batched matmuls.

``y = base(x) + (x @ A[slot]^T) @ B[slot]^T * scale[slot]``, ``slot`` being the row's entry of
the step's ``adapter_ids``; slot 0 holds zeros, so a row without an adapter gets the base
projection exactly. The stacked A and B are parameters of the projection, filled from the
adapters by the ``lora-adapters`` state-dict converter.

A decode step (one token per row) with ``B`` stored rank-major (``lora_memory_transpose``)
computes both products as sums over the row's own slot, which the compiler fuses with the
slot lookup: each row's A and B are read where they are stored, once, instead of being
gathered into a copy for two batched matmuls (measured: that copy and the matmuls' calls made
the adapters cost about a third more per step). Several tokens per row (prompts) use the
batched matmuls, whose weights are reused across the tokens.

A target projection becomes its LoRA twin (its class swapped in place, as
``torch.nn.utils.parametrize`` does, so its weights and sharding stay as they are): a column
parallel one adds the delta to its output slice, a row parallel one adds its partial delta to
its partial sum, before the all-reduce (see :mod:`nxdplug.plugins.lora.layout` for which part of
A and B each rank holds and uses).

On a quantized base model (``quantized=True``) the projection is the weight-quantization
plugin's 8-bit layer, and the twin is made on top of whatever class the projection has: the base
term is the dequantized weight's, the adapters stay in full precision and their delta is added in
the activations' dtype. Either plugin's transform may run first: each swaps the class in place
and keeps what the other added.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from nxdplug.plugin_api import (
    ColumnParallelLinear,
    NotSupportedError,
    NxdPlugError,
    RowParallelLinear,
    current_step,
)
from nxdplug.plugins.lora.adapters import slot_count
from nxdplug.plugins.lora.layout import (
    Placement,
    is_model_target,
    model_targets,
    placement,
    stacked_rank,
)
from nxdplug.plugins.lora.store import AdapterStore

LORA_WEIGHTS = ("lora_a", "lora_b", "lora_scale")


class LoraProjection:
    """What a target projection gains: stacked ``lora_a`` [slots, rank, in], ``lora_b``
    ([slots, rank, out] or [slots, out, rank], see ``Placement.rank_major_b``) and
    ``lora_scale`` [slots] (as this rank keeps them), and the delta."""

    lora_a: nn.Parameter
    lora_b: nn.Parameter
    lora_scale: nn.Parameter
    lora_placement: Placement

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's adapter term for this rank's part of the projection."""
        chosen = current_step()["adapter_ids"]
        where = self.lora_placement
        a, b = where.used(self.lora_a[chosen], self.lora_b[chosen])
        scale = self.lora_scale[chosen]
        if where.rank_major_b and x.shape[1] == 1:
            return one_token_delta(x, a, b, scale, where.local_partitions)
        b_rank_major = b if where.rank_major_b else b.transpose(1, 2)
        return torch.bmm(torch.bmm(x, a.transpose(1, 2)), b_rank_major) * scale[:, None, None]

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The base layer's shard, and the part of the whole LoRA weights this rank keeps."""
        lora = {name: full[name] for name in LORA_WEIGHTS if name in full}
        base = {name: t for name, t in full.items() if name not in lora}
        if "lora_a" in lora:
            lora["lora_a"], lora["lora_b"] = self.lora_placement.stored(
                lora["lora_a"], lora["lora_b"]
            )
        return super().shard_state_dict(base) | lora


def one_token_delta(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    partitions: tuple[int, ...] = (),
) -> torch.Tensor:
    """``x`` [rows, 1, in] times each row's ``a`` [rows, r, in] and rank-major ``b`` [rows,
    r, out], scaled, in float32: as sums, so that no gathered copy of ``a`` and ``b`` is made.
    With ``partitions`` (fused Q/K/V) ``b`` is block diagonal: each part's block only."""
    low = (a.float() * x.float()).sum(-1) * scale.float()[:, None]
    if not partitions:
        return (b.float() * low[:, :, None]).sum(1)[:, None, :]
    rank = b.shape[1] // len(partitions)
    starts = [sum(partitions[:i]) for i in range(len(partitions))]
    parts = [
        (
            b[:, i * rank : (i + 1) * rank, start : start + size].float()
            * low[:, i * rank : (i + 1) * rank, None]
        ).sum(1)
        for i, (start, size) in enumerate(zip(starts, partitions, strict=True))
    ]
    return torch.cat(parts, dim=-1)[:, None, :]


class LoraColumnParallelLinear(LoraProjection, ColumnParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + self.lora_delta(x).to(out.dtype)


class LoraRowParallelLinear(LoraProjection, RowParallelLinear):
    def partial_sum(self, x: torch.Tensor) -> torch.Tensor:
        out = super().partial_sum(x)
        return out + self.lora_delta(x).to(out.dtype)


LORA_TWINS: dict[type[nn.Module], type[nn.Module]] = {
    ColumnParallelLinear: LoraColumnParallelLinear,
    RowParallelLinear: LoraRowParallelLinear,
}


@functools.cache
def lora_twin(cls: type[nn.Module]) -> type[nn.Module] | None:
    """The LoRA class of a projection class: its twin above; for a subclass another feature
    made (an 8-bit quantized projection), the twin on top of it, so that its base projection
    (``weight_for``) is the subclass's; None for anything else or if it has LoRA already."""
    if cls in LORA_TWINS:
        return LORA_TWINS[cls]
    if issubclass(cls, LoraProjection):
        return None
    for base, twin in LORA_TWINS.items():
        if issubclass(cls, base):
            return type(f"Lora{cls.__name__}", (twin, cls), {"__module__": __name__})
    return None


def add_lora_weights(model: nn.Module, context: Any) -> None:
    """The ``transform_model`` callback: every target projection becomes its LoRA twin."""
    config = context.config
    names = model_targets(config)
    count = slot_count(config)
    for name, module in model.named_modules():
        if is_model_target(name, names):
            _become_lora_twin(name, module, placement(name, config), count, config)


def _become_lora_twin(
    name: str, module: nn.Module, where: Placement, count: int, config: Any
) -> None:
    twin = lora_twin(type(module))
    if twin is None:
        raise NotSupportedError(
            f"{name} is a {type(module).__name__}; LoRA adapters apply to ColumnParallelLinear "
            "and RowParallelLinear projections"
        )
    column = issubclass(twin, LoraColumnParallelLinear)
    layout = (module.tp_degree, module.rank, tuple(module.partitions) if column else ())
    if layout != (where.tp_degree, where.rank, where.partitions or layout[2]):
        raise NotSupportedError(
            f"{name} is split over its {module.tp_degree} rank(s) as (ranks, rank, parts) = "
            f"{layout}, not as multi-LoRA lays its adapters out ({where})"
        )
    if column and module.gather_output and module.tp_degree > 1:
        raise NotSupportedError(
            f"{name} gathers its output over the ranks (gather_output=True); LoRA adds each "
            "rank's slice of the delta, so it serves projections that keep their slice"
        )
    rank = stacked_rank(name, config)
    a, b = where.stored(
        torch.zeros(count, rank, module.in_features),
        torch.zeros(where.stacked_b_shape(count, module.out_features, rank)),
    )
    module.__class__ = twin
    module.lora_placement = where
    module.lora_a = nn.Parameter(a)
    module.lora_b = nn.Parameter(b)
    module.lora_scale = nn.Parameter(torch.zeros(count))


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
        chosen = self._slots_of(given, device)
        if chosen.shape != (batch_size,):
            raise NxdPlugError(
                f"adapter_ids has {len(chosen)} entries for {batch_size} rows; give one per row "
                "(None for the base model)"
            )
        return {"adapter_ids": chosen}

    def _slots_of(self, given: Any, device: torch.device) -> torch.Tensor:
        if isinstance(given, torch.Tensor):
            chosen = given.long().flatten()
            last = self.store.max_slots
            bad = [int(s) for s in chosen if not 0 <= int(s) <= last]
            if bad:
                raise NxdPlugError(
                    f"adapter_ids slots {bad} do not exist: 0 is the base model, 1...{last} "
                    "the adapter slots"
                )
            return chosen.to(device)
        if isinstance(given, str) or not isinstance(given, Sequence):
            raise NxdPlugError("adapter_ids must be a list with an adapter id (or None) per row")
        return torch.tensor(self.store.slots_for(given), dtype=torch.long, device=device)

    def row_problem(self, keyword: str, value: Any) -> str | None:
        """The serving engine's check of one request's adapter id (None: the base model)."""
        if value is not None and (not isinstance(value, str) or value not in self.store.paths):
            return f"{keyword}={value!r} is not among the served adapters {list(self.store.paths)}"
        return None

    def rows_fit(self, keyword: str, values: Sequence[Any]) -> bool:
        """Rows fit in one step while their adapters fit in the slots."""
        return len({v for v in values if v is not None}) <= self.store.max_slots

    def served_names(self) -> dict[str, dict[str, Any]]:
        """Each served adapter as a model name of its own, as vLLM names them."""
        return {adapter_id: {"adapter_ids": adapter_id} for adapter_id in self.store.paths}

    def reset(self) -> None:
        """Nothing carries over between generations (the slots stay as they are)."""
