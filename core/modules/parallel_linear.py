"""Tensor-parallel linear and embedding layers (Megatron style), as in NxD.

Each rank holds one shard of the full weight. ``ColumnParallelLinear`` splits the output
features, ``RowParallelLinear`` the input features, ``ParallelEmbedding`` the embedding dim.
Collectives go through the small wrappers below, over a named process group (``tp`` unless a
layer names another, see :mod:`nxdplug.modules.process_groups`); without an initialized group
of more than one rank the forward passes make no distributed call, so a single process can run
each rank's shard on its own (that is how the tests check the sharding).
Whether to communicate is decided on the host from the group size, never from tensor values,
so forward traces to one graph. The all-reduce is a custom op, ``nxdplug::all_reduce_sum``,
which torch.export records as one node and a compiled graph calls back into, so a compiled rank
talks to the others by itself. (torch's functional collectives compiled by AOTInductor hung
after a few back-to-back calls over gloo with torch 2.13; the custom op runs the ordinary,
synchronous ``dist.all_reduce``.)
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from nxdplug.errors import ConfigError
from nxdplug.modules.process_groups import TP, current_layout, group_rank, group_size
from nxdplug.slots import claim_slot

TensorDict = dict[str, Tensor]


def tp_world_size() -> int:
    """Ranks in the ``tp`` group, all the launched ranks; 1 without torch.distributed."""
    return group_size(TP)


def tp_rank() -> int:
    """This process's rank in the ``tp`` group; 0 without torch.distributed."""
    return group_rank(TP)


def use_collectives(tp_degree: int, group: str = TP) -> bool:
    """Whether a layer sharded ``tp_degree`` ways over ``group`` must talk to the other ranks.

    No for a single rank (each rank's shard then runs on its own) or an unsharded layer; a
    group whose size is not ``tp_degree`` is a configuration error.
    """
    if tp_degree == 1:
        return False
    size = group_size(group)
    if size == 1:
        return False
    if size != tp_degree:
        raise ConfigError(
            [f"tp_degree is {tp_degree} but the process group has {size} ranks (group {group!r})"]
        )
    return True


@torch.library.custom_op("nxdplug::all_reduce_sum", mutates_args=())
def all_reduce_sum(tensor: torch.Tensor, group: str = TP) -> torch.Tensor:
    """The sum of ``tensor`` over the ranks of this process's group ``group``, as a new
    tensor."""
    total = tensor.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=current_layout().process_group(group))
    return total


@all_reduce_sum.register_fake
def _all_reduce_sum_shape(tensor: torch.Tensor, group: str = TP) -> torch.Tensor:
    return torch.empty_like(tensor)


def all_gather(
    tensor: torch.Tensor, dim: int, rank: int, world: int, group: str = TP
) -> torch.Tensor:
    """Every rank's ``tensor`` side by side along ``dim``, in rank order within ``group``.

    Each rank puts its part in zeros at its own offset and the ranks' tensors are summed: adding
    zeros is exact, and all-reduce is the collective AOTInductor's CPU runtime provides.
    """
    size = tensor.shape[dim]
    pad = [0, 0] * (tensor.dim() - dim % tensor.dim() - 1)
    pad += [rank * size, (world - rank - 1) * size]
    return all_reduce_sum(F.pad(tensor, pad), group)


def all_gather_last_dim(
    tensor: torch.Tensor, rank: int, world: int, group: str = TP
) -> torch.Tensor:
    """:func:`all_gather` along the last dim (column-parallel outputs, embedding widths)."""
    return all_gather(tensor, -1, rank, world, group)


def shard_size(size: int, tp_degree: int, what: str) -> int:
    """``size // tp_degree``, or a ConfigError saying ``what`` does not split evenly."""
    if size % tp_degree:
        raise ConfigError([f"{what} ({size}) is not divisible by tp_degree ({tp_degree})"])
    return size // tp_degree


def _check_rank(tp_degree: int, rank: int) -> None:
    if tp_degree < 1 or not 0 <= rank < tp_degree:
        raise ConfigError(
            [f"need tp_degree >= 1 and 0 <= rank < tp_degree; got {tp_degree=}, {rank=}"]
        )


def shard_tensor(tensor: torch.Tensor, dim: int, tp_degree: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``tensor`` cut into ``tp_degree`` equal parts along ``dim``."""
    _check_rank(tp_degree, rank)
    size = shard_size(
        tensor.shape[dim], tp_degree, f"dim {dim} of a tensor of shape {list(tensor.shape)}"
    )
    return tensor.narrow(dim, rank * size, size).contiguous()


def _init_uniform(tensor: torch.Tensor | None, fan_in: int) -> None:
    # nn.Linear's default init, with the fan-in of the full (unsharded) layer.
    if tensor is not None:
        bound = 1 / math.sqrt(fan_in)
        nn.init.uniform_(tensor, -bound, bound)


class WeightMethod:
    """How a linear layer holds its weight (vLLM's ``quant_method``); this base is the default,
    the float ``weight``. Another form's ``create_weights`` puts its (unloaded) parameters on
    the layer, under the checkpoint's names; the method object itself holds no tensors."""

    def create_weights(self, layer: ShardedLinear) -> None:
        pass

    def apply(self, layer: ShardedLinear, x: Tensor, bias: Tensor | None) -> Tensor:
        """``x @ W.T + bias`` on this rank's shard."""
        return F.linear(x, layer.weight, bias)

    def shard_state_dict(self, layer: ShardedLinear, full: TensorDict) -> TensorDict:
        """This rank's part of the full weight tensors, by the layer's rule for row order."""
        return layer.shard_weights(full)


class OutputDelta(Protocol):
    """A term added to a linear layer's product (LoRA's ``x @ A.T @ B.T``) on this rank's
    part, before a row-parallel layer's all-reduce; ``shard_state_dict`` gives this rank's part
    of the full tensors of its ``parameter_names``, which are the layer's parameters."""

    parameter_names: tuple[str, ...]

    def compute(self, layer: ShardedLinear, x: Tensor) -> Tensor: ...
    def shard_state_dict(self, layer: ShardedLinear, full: TensorDict) -> TensorDict: ...


class ShardedLinear(nn.Module):
    """What the column- and row-parallel layers share: this rank's shard of the weight, held
    and multiplied by ``weight_method``, the ``bias``, and the ``output_deltas`` added to the
    product (a plugin appends its own)."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self) -> None:
        super().__init__()
        self.weight_method = WeightMethod()
        self.output_deltas: tuple[OutputDelta, ...] = ()

    def product(self, x: Tensor, bias: Tensor | None) -> Tensor:
        out = self.weight_method.apply(self, x, bias)
        for delta in self.output_deltas:
            out = out + delta.compute(self, x).to(out.dtype)
        return out

    def shard_state_dict(self, full: TensorDict) -> TensorDict:
        """This rank's part of the full layer's tensors: each delta's by the delta, the rest by
        the weight method."""
        rest, shards = dict(full), {}
        for delta in self.output_deltas:
            owned = {name: rest.pop(name) for name in delta.parameter_names if name in rest}
            shards |= delta.shard_state_dict(self, owned)
        return self.weight_method.shard_state_dict(self, rest) | shards

    def shard_weights(self, full: TensorDict) -> TensorDict:
        raise NotImplementedError


def set_weight_method(layer: ShardedLinear, method: WeightMethod, claimant: str) -> None:
    """Give ``layer`` ``method`` on behalf of ``claimant`` (a plugin) and create its weights:
    the layer's ``weight_method`` slot, so a second plugin's claim is refused, naming both."""
    claim_slot(layer, "weight_method", method, claimant=claimant)
    method.create_weights(layer)


class ColumnParallelLinear(ShardedLinear):
    """``y = x W^T + b`` with W split along the output features: this rank holds rows
    ``[rank * out/tp, (rank + 1) * out/tp)`` of W and of b.

    The output is this rank's slice of the features, or all of them with ``gather_output``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        gather_output: bool = False,
        tp_degree: int = 1,
        rank: int = 0,
        dtype: torch.dtype | None = None,
        partitions: tuple[int, ...] = (),
        group: str = TP,
    ) -> None:
        """``partitions``: the output sizes of the projections fused into this one (Q, K, V),
        each split over the ranks on its own; one projection by default. ``group``: the process
        group the layer is sharded over (``tp_degree`` is its size, ``rank`` this rank's place
        in it)."""
        super().__init__()
        _check_rank(tp_degree, rank)
        self.group = group
        self.in_features = in_features
        self.out_features = out_features
        self.gather_output = gather_output
        self.tp_degree = tp_degree
        self.rank = rank
        self.partitions = partitions or (out_features,)
        if sum(self.partitions) != out_features:
            raise ConfigError([f"partitions {partitions} do not add up to {out_features}"])
        local_out = sum(shard_size(p, tp_degree, "out_features") for p in self.partitions)
        self.weight = nn.Parameter(torch.empty(local_out, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local_out, dtype=dtype)) if bias else None
        _init_uniform(self.weight, in_features)
        _init_uniform(self.bias, in_features)

    def shard_weights(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's rows of the full layer's tensors (weight, bias, per-row scales), part by
        part for a fused projection; a one-row tensor (a per-tensor scale) stays whole."""
        return {
            name: self._rows_of_this_rank(t) if t.shape[0] == self.out_features else t
            for name, t in full.items()
        }

    def _rows_of_this_rank(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = tensor.split(list(self.partitions))
        return torch.cat([shard_tensor(p, 0, self.tp_degree, self.rank) for p in parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x, self.bias)
        if self.gather_output and use_collectives(self.tp_degree, self.group):
            out = all_gather_last_dim(out, self.rank, self.tp_degree, self.group)
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, "
            f"tp_degree={self.tp_degree}, rank={self.rank}"
        )


class RowParallelLinear(ShardedLinear):
    """``y = x W^T + b`` with W split along the input features.

    This rank multiplies its slice of the input features (the input itself when
    ``input_is_parallel``, as after a ColumnParallelLinear) by its columns of W; the partial
    results are summed over the ranks, in ``reduce_dtype`` when given (NxD's
    ``rpl_reduce_dtype``), and the full bias is added once, after the sum.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        input_is_parallel: bool = True,
        tp_degree: int = 1,
        rank: int = 0,
        reduce_dtype: torch.dtype | None = None,
        dtype: torch.dtype | None = None,
        group: str = TP,
    ) -> None:
        super().__init__()
        _check_rank(tp_degree, rank)
        self.group = group
        self.in_features = in_features
        self.out_features = out_features
        self.input_is_parallel = input_is_parallel
        self.tp_degree = tp_degree
        self.rank = rank
        self.reduce_dtype = reduce_dtype
        self.local_in = shard_size(in_features, tp_degree, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        _init_uniform(self.weight, in_features)
        _init_uniform(self.bias, in_features)

    def shard_weights(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's columns of the full weight; the bias and scales (per output row, or one)
        are whole on every rank."""
        return {
            name: shard_tensor(t, 1, self.tp_degree, self.rank) if name == "weight" else t
            for name, t in full.items()
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = x.narrow(-1, self.rank * self.local_in, self.local_in)
        out = self.product(x, None)  # with the deltas, so that one all-reduce sums them all
        if use_collectives(self.tp_degree, self.group):
            dtype = out.dtype
            out = all_reduce_sum(out.to(self.reduce_dtype or dtype), self.group).to(dtype)
        if self.bias is not None:
            out = out + self.bias
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
            f"tp_degree={self.tp_degree}, rank={self.rank}, reduce_dtype={self.reduce_dtype}"
        )


class ParallelEmbedding(nn.Module):
    """An embedding table split along the embedding dim; forward gathers the full vectors."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_degree: int = 1,
        rank: int = 0,
        dtype: torch.dtype | None = None,
        group: str = TP,
    ) -> None:
        super().__init__()
        _check_rank(tp_degree, rank)
        self.group = group
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_degree = tp_degree
        self.rank = rank
        local_dim = shard_size(embedding_dim, tp_degree, "embedding_dim")
        self.weight = nn.Parameter(torch.empty(num_embeddings, local_dim, dtype=dtype))
        nn.init.normal_(self.weight)

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's columns of the full embedding table."""
        return {"weight": shard_tensor(full["weight"], 1, self.tp_degree, self.rank)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(input_ids, self.weight)
        if use_collectives(self.tp_degree, self.group):
            out = all_gather_last_dim(out, self.rank, self.tp_degree, self.group)
        return out

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"tp_degree={self.tp_degree}, rank={self.rank}"
        )
