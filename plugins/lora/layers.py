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

A target projection gets the stacked weights as parameters and a :class:`LoraDelta` among its
output deltas (its weights and sharding stay as they are): a column parallel one adds the delta
to its output slice, a row parallel one adds its partial delta to its partial sum, before the
all-reduce (see :mod:`nxdplug.plugins.lora.layout` for which part of A and B each rank holds and
uses).

On a quantized base model (``quantized=True``) the projection's weight method is the
weight-quantization plugin's: the base term is the quantized weight's, the adapters stay in full
precision and their delta is added in the activations' dtype. Either plugin's transform may run
first: one sets the weight method, the other adds a delta.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nxdplug.plugin_api import (
    ColumnParallelLinear,
    NotSupportedError,
    NxdPlugError,
    ShardedLinear,
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

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, PipelineContext

LORA_WEIGHTS = ("lora_a", "lora_b", "lora_scale")


class LoraDelta:
    """A target projection's output delta: each row's adapter term from the stacked ``lora_a``
    [slots, rank, in], ``lora_b`` ([slots, rank, out] or [slots, out, rank], see
    ``Placement.rank_major_b``) and ``lora_scale`` [slots], parameters of the projection (as
    this rank keeps them), laid out as ``placement`` says."""

    parameter_names = LORA_WEIGHTS

    def __init__(self, placement: Placement) -> None:
        self.placement = placement

    def compute(self, layer: ShardedLinear, x: torch.Tensor) -> torch.Tensor:
        """Each row's adapter term for this rank's part of the projection."""
        chosen = current_step()["adapter_ids"]
        where = self.placement
        a, b = where.used(layer.lora_a[chosen], layer.lora_b[chosen])
        scale = layer.lora_scale[chosen]
        if where.rank_major_b and x.shape[1] == 1:
            return one_token_delta(x, a, b, scale, where.local_partitions)
        b_rank_major = b if where.rank_major_b else b.transpose(1, 2)
        return torch.bmm(torch.bmm(x, a.transpose(1, 2)), b_rank_major) * scale[:, None, None]

    def shard_state_dict(
        self, layer: ShardedLinear, full: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The part of the whole LoRA weights this rank keeps."""
        if "lora_a" not in full:
            return full
        a, b = self.placement.stored(full["lora_a"], full["lora_b"])
        return {**full, "lora_a": a, "lora_b": b}


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


def add_lora_weights(model: nn.Module, context: PipelineContext) -> None:
    """The ``transform_model`` callback: every target projection gets its adapters' delta."""
    config = context.config
    names = model_targets(config)
    count = slot_count(config)
    for name, module in model.named_modules():
        if is_model_target(name, names):
            add_lora_delta(name, module, placement(name, config), count, config)


def add_lora_delta(
    name: str, module: nn.Module, where: Placement, count: int, config: InferenceConfig
) -> None:
    """Stacked, empty adapter weights on ``module`` and their delta added to its product."""
    if not isinstance(module, ShardedLinear) or any(
        isinstance(delta, LoraDelta) for delta in module.output_deltas
    ):
        raise NotSupportedError(
            f"{name} is a {type(module).__name__}; LoRA adapters apply once to "
            "ColumnParallelLinear and RowParallelLinear projections"
        )
    column = isinstance(module, ColumnParallelLinear)
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
    module.lora_a = nn.Parameter(a)
    module.lora_b = nn.Parameter(b)
    module.lora_scale = nn.Parameter(torch.zeros(count))
    module.output_deltas = (*module.output_deltas, LoraDelta(where))


class AdapterSlots:
    """The host side of ``adapter_ids``: one entry per row, an adapter id or None for the base
    model (or, as a tensor, the slots themselves: 0 for the base model). With dynamic
    multi-LoRA, ids not in a slot are brought in (see :mod:`nxdplug.plugins.lora.store`)."""

    def __init__(self, config: InferenceConfig) -> None:
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
