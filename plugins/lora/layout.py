"""The adapters' matrices in the model's layout, stacked into slots, and each rank's part.

PEFT keeps one ``A`` [r, in] and ``B`` [out, r] per projection of the HF model. The model's own
projections may differ, and the adapters follow the base weights:

- K/V heads replicated for tensor parallelism (GQA ``REPLICATE_TO_TP_DEGREE`` or
  ``CONVERT_TO_MHA``): ``B`` of k_proj / v_proj has its rows (output features, head by head)
  replicated like the base weight; ``A`` is unchanged.
- query heads padded to a multiple of tp_degree: ``B`` of q_proj gets zero rows and ``A`` of
  o_proj zero columns where the base weights have their zero heads.
- ``fused_qkv``: one ``qkv_proj``. Its ``A`` stacks the three A's along the rank
  ([3 * max_lora_rank, in], q's first) and its ``B`` is block diagonal ([q + 2 * kv,
  3 * max_lora_rank]), so that ``x A^T B^T`` is the three deltas side by side.

With tensor parallelism every rank computes the delta of its shard of the projection:

- column parallel (q/k/v or qkv, gate/up; output features split): all of ``A`` and this rank's
  rows of ``B`` (part by part for qkv) give this rank's slice of the delta.
- row parallel (o/down; input features split): this rank's columns of ``A`` times all of
  ``B``, from the rank's slice of the input, give a partial delta. It is added to the layer's
  own partial sum before the layer's all-reduce, so the one all-reduce sums both: no second
  collective, and no rank needs the whole input.

``lora_shard_linear_layer=True`` stores only that part on each rank (cut when the weights are
loaded, and when an adapter is written into a slot); ``False`` keeps ``A`` and ``B`` whole on
every rank and cuts them in the graph at each step: more memory, the same result.

``lora_memory_transpose=True`` (the default) stores each slot's ``B`` transposed, rank-major
([r, out]), so that a decode step reads a row's ``B`` along its output features, as the
one-token delta of :mod:`nxdplug.plugins.lora.layers` wants; ``False`` keeps PEFT's [out, r].
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import torch

from nxdplug.plugin_api import (
    CheckpointError,
    attention_head_counts,
    head_dim_of,
    head_layout,
    shard_tensor,
    tp_rank,
    tp_world_size,
)
from nxdplug.plugins.lora.adapters import (
    adapter_matrices,
    adapters,
    slot_count,
    slots,
    targets,
)

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

QKV = ("q_proj", "k_proj", "v_proj")
FUSED_QKV = "qkv_proj"
ROW_PARALLEL = ("o_proj", "down_proj")
Matrices = dict[str, tuple[torch.Tensor, torch.Tensor]]
_PROJECTION = re.compile(r"^layers\.\d+\.(?:self_attn|mlp)\.(\w+)$")


@attrs.frozen
class Placement:
    """How one rank holds and uses a target projection's LoRA matrices.

    ``partitions``: the whole output sizes of the projections fused into this one (Q, K, V),
    each split over the ranks on its own, as the base layer splits them. ``rank_major_b``:
    ``B`` is stored [..., r, out] (``lora_memory_transpose``), else [..., out, r].
    """

    row_parallel: bool
    tp_degree: int = 1
    rank: int = 0
    sharded: bool = True
    partitions: tuple[int, ...] = ()
    rank_major_b: bool = False

    @property
    def b_out_dim(self) -> int:
        """The dim of the stored ``B`` that runs over the output features."""
        return -1 if self.rank_major_b else -2

    @property
    def local_partitions(self) -> tuple[int, ...]:
        """The output sizes of the fused projections in this rank's slice."""
        return tuple(size // self.tp_degree for size in self.partitions)

    def laid_out_b(self, b: torch.Tensor) -> torch.Tensor:
        """``B`` [..., out, r], as PEFT saves it, in the stored layout."""
        return b.transpose(-1, -2) if self.rank_major_b else b

    def stacked_b_shape(self, slots: int, out_features: int, rank: int) -> tuple[int, ...]:
        return (slots, rank, out_features) if self.rank_major_b else (slots, out_features, rank)

    def cut(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of whole ``A`` [..., r, in] and ``B`` (stored layout)."""
        if self.tp_degree == 1:
            return a, b
        if self.row_parallel:
            return shard_tensor(a, a.dim() - 1, self.tp_degree, self.rank), b
        out_dim = b.dim() + self.b_out_dim
        parts = b.split(list(self.partitions), dim=out_dim) if self.partitions else (b,)
        rows = [shard_tensor(p, out_dim, self.tp_degree, self.rank) for p in parts]
        return a, torch.cat(rows, dim=out_dim)

    def stored(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What this rank keeps of whole ``A`` and ``B``."""
        return self.cut(a, b) if self.sharded else (a, b)

    def used(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What this rank multiplies by, from what it keeps."""
        return (a, b) if self.sharded else self.cut(a, b)

    def whole_sizes(self, lora_a: torch.Tensor, lora_b: torch.Tensor) -> tuple[int, int]:
        """(out, in) of the whole projection whose kept stacked weights are these."""
        out_features, in_features = lora_b.shape[self.b_out_dim], lora_a.shape[-1]
        if not self.sharded:
            return out_features, in_features
        if self.row_parallel:
            return out_features, in_features * self.tp_degree
        return out_features * self.tp_degree, in_features


def model_targets(config: InferenceConfig) -> tuple[str, ...]:
    """The model's projections that carry LoRA weights: the adapters' targets, with q/k/v as
    ``qkv_proj`` when the model fuses them."""
    names = targets(config)
    if not config.neuron_config.fused_qkv or not set(QKV) & set(names):
        return names
    return (FUSED_QKV, *(name for name in names if name not in QKV))


def is_model_target(module_name: str, names: tuple[str, ...]) -> bool:
    """Whether ``module_name`` (``layers.3.self_attn.q_proj``) is a projection in ``names``."""
    match = _PROJECTION.match(module_name)
    return match is not None and match.group(1) in names


def stacked_rank(projection: str, config: InferenceConfig) -> int:
    """The rank dim of a projection's stacked weights: ``max_lora_rank``, three of them for
    the fused qkv."""
    rank = config.neuron_config.lora_config.max_lora_rank
    return 3 * rank if projection.endswith(FUSED_QKV) else rank


def _qkv_sizes(config: InferenceConfig) -> tuple[int, int, int]:
    """The output sizes of Q, K and V in the model (K/V heads replicated)."""
    heads, kv_heads = attention_head_counts(config)
    head_dim = head_dim_of(config)
    return heads * head_dim, kv_heads * head_dim, kv_heads * head_dim


def placement(projection: str, config: InferenceConfig) -> Placement:
    """How this rank holds the projection ``projection`` (a module name or its last part)."""
    short = projection.rpartition(".")[2]
    lora_config = config.neuron_config.lora_config
    return Placement(
        row_parallel=short in ROW_PARALLEL,
        tp_degree=tp_world_size(),
        rank=tp_rank(),
        sharded=lora_config.lora_shard_linear_layer,
        partitions=_qkv_sizes(config) if short == FUSED_QKV else (),
        rank_major_b=lora_config.lora_memory_transpose,
    )


def whole(projection: str, config: InferenceConfig) -> Placement:
    """How the whole (unsplit) stacked weights of ``projection`` are laid out."""
    return attrs.evolve(placement(projection, config), tp_degree=1, rank=0)


def in_model_layout(matrices: Matrices, adapter_id: str, config: InferenceConfig) -> Matrices:
    """An adapter's matrices (``adapter_matrices``) for the model's projections: K/V heads
    replicated and query heads padded like the base weights, q/k/v fused when the model fuses
    them."""
    layout = head_layout(config)
    head_dim = head_dim_of(config)
    source_rows = {
        "q_proj": layout.num_attention_heads * head_dim,
        "k_proj": layout.num_key_value_heads * head_dim,
        "v_proj": layout.num_key_value_heads * head_dim,
    }
    laid_out = dict(matrices)
    for name, (a, b) in matrices.items():
        short = name.rpartition(".")[2]
        if b.shape[0] != source_rows.get(short, b.shape[0]):
            continue  # refused by write_slot, naming the adapter and the shapes
        if short in ("k_proj", "v_proj"):
            laid_out[name] = (a, layout.kv_heads(b, head_dim))
        elif short == "q_proj":
            laid_out[name] = (a, layout.query_heads(b, head_dim))
        elif short == "o_proj" and a.shape[1] == source_rows["q_proj"]:
            laid_out[name] = (layout.query_heads(a, head_dim, dim=1), b)
    if config.neuron_config.fused_qkv:
        laid_out = _fuse_qkv(laid_out, adapter_id, config)
    return laid_out


def _fuse_qkv(matrices: Matrices, adapter_id: str, config: InferenceConfig) -> Matrices:
    rank = config.neuron_config.lora_config.max_lora_rank
    sizes = _qkv_sizes(config)
    fused = dict(matrices)
    attention = {name.rpartition(".")[0] for name in matrices if name.endswith(QKV)}
    for prefix in sorted(attention):
        parts = [fused.pop(f"{prefix}.{name}", None) for name in QKV]
        hidden = next(a.shape[1] for a, _ in filter(None, parts))
        a_fused = torch.zeros(3 * rank, hidden)
        b_fused = torch.zeros(sum(sizes), 3 * rank)
        row = 0
        for i, (name, size, part) in enumerate(zip(QKV, sizes, parts, strict=True)):
            if part is not None:
                a, b = part
                if b.shape[0] != size or a.shape[1] != hidden:
                    raise CheckpointError(
                        f"LoRA adapter {adapter_id!r}: {prefix}.{name} is [{b.shape[0]} x "
                        f"{a.shape[1]}] in the adapter but [{size} x {hidden}] in the model; it "
                        "was trained for another model"
                    )
                a_fused[i * rank : i * rank + a.shape[0]] = a
                b_fused[row : row + size, i * rank : i * rank + b.shape[1]] = b
            row += size
        fused[f"{prefix}.{FUSED_QKV}"] = (a_fused, b_fused)
    return fused


def add_adapter_weights(
    state_dict: dict[str, torch.Tensor], config: InferenceConfig
) -> dict[str, Any]:
    """The converter: for every target projection ``P`` of the checkpoint, ``P.lora_a``
    [slots, rank, in], ``P.lora_b`` [slots, out, rank] and ``P.lora_scale`` [slots] (whole:
    each rank's part is cut when it loads them), the start-up adapters in their slots; slot 0,
    empty slots and the ranks above an adapter's own are zeros."""
    names = model_targets(config)
    count = slot_count(config)
    stacked: dict[str, torch.Tensor] = {}
    for key, weight in state_dict.items():
        projection = key.removesuffix(".weight")
        if key.endswith(".weight") and is_model_target(projection, names):
            rank = stacked_rank(projection, config)
            b_shape = whole(projection, config).stacked_b_shape(count, weight.shape[0], rank)
            stacked[f"{projection}.lora_a"] = torch.zeros(count, rank, weight.shape[1])
            stacked[f"{projection}.lora_b"] = torch.zeros(b_shape)
            stacked[f"{projection}.lora_scale"] = torch.zeros(count)
    by_id = {adapter.adapter_id: adapter for adapter in adapters(config)}
    for adapter_id, slot in slots(config).items():
        adapter = by_id[adapter_id]
        matrices = in_model_layout(adapter_matrices(adapter), adapter_id, config)
        write_slot(stacked, slot, adapter_id, matrices, adapter.scale, lambda p: whole(p, config))
    return state_dict | stacked


def write_slot(
    weights: dict[str, torch.Tensor],
    slot: int,
    adapter_id: str,
    matrices: Matrices,
    scale: float,
    placement_of: Callable[[str], Placement],
) -> None:
    """Put one adapter's matrices (in the model's layout) into ``slot`` of the stacked LoRA
    weights (``P.lora_a``, ``P.lora_b``, ``P.lora_scale`` by projection), zeros where it trains
    nothing; ``placement_of(P)`` says which part of them the weights hold."""
    unknown = sorted(set(matrices) - {k.removesuffix(".lora_a") for k in weights})
    if unknown:
        raise CheckpointError(
            f"LoRA adapter {adapter_id!r} has weights for {unknown}, which the model does not "
            "carry LoRA weights for (an adapter for another model, or a projection outside "
            "lora_config.target_modules)"
        )
    for key in [k for k in weights if k.endswith(".lora_a")]:
        projection = key.removesuffix(".lora_a")
        lora_a, lora_b = weights[key], weights[f"{projection}.lora_b"]
        where = placement_of(projection)
        out_features, in_features = where.whole_sizes(lora_a, lora_b)
        a, b = matrices.get(projection, (lora_a.new_zeros(0, in_features), None))
        if b is None:
            b = lora_b.new_zeros(out_features, 0)
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise CheckpointError(
                f"LoRA adapter {adapter_id!r}: {projection} is [{b.shape[0]} x {a.shape[1]}] in "
                f"the adapter but [{out_features} x {in_features}] in the model; it was "
                "trained for another model"
            )
        a, b = where.stored(a, where.laid_out_b(b))
        with torch.no_grad():
            lora_a[slot].zero_()
            lora_b[slot].zero_()
            lora_a[slot, : a.shape[0]] = a
            if where.rank_major_b:
                lora_b[slot, : b.shape[0]] = b
            else:
                lora_b[slot, :, : b.shape[1]] = b
            weights[f"{projection}.lora_scale"][slot] = scale if projection in matrices else 0.0
