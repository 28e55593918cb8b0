"""SharedExperts: the MLP every token goes through, beside the routed experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nxdplug.modules.activations import activation
from nxdplug.modules.parallel_linear import (
    TP,
    all_reduce_sum,
    shard_size,
    shard_tensor,
    use_collectives,
)


class Projection(nn.Module):
    """A bias-free linear layer stored [out, in], or [in, out] when ``transposed``, and split
    over ranks along ``split`` ("out" or "in"); a fused projection's ``parts`` are split each
    on its own."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        split: str,
        transposed: bool,
        parts: int = 1,
        tp_degree: int = 1,
        rank: int = 0,
    ) -> None:
        super().__init__()
        self.transposed, self.parts = transposed, parts
        self.tp_degree, self.rank = tp_degree, rank
        what = "shared experts' intermediate size"
        if split == "out":
            out_features = shard_size(out_features, tp_degree, what)
        else:
            in_features = shard_size(in_features, tp_degree, what)
        shape = (in_features, out_features) if transposed else (out_features, in_features)
        out_dim, in_dim = (1, 0) if transposed else (0, 1)
        self.split_dim = out_dim if split == "out" else in_dim
        self.weight = nn.Parameter(torch.empty(shape))
        nn.init.uniform_(self.weight, -(in_features**-0.5), in_features**-0.5)

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        parts = full["weight"].chunk(self.parts, dim=self.split_dim)
        shards = [shard_tensor(p, self.split_dim, self.tp_degree, self.rank) for p in parts]
        return {"weight": torch.cat(shards, dim=self.split_dim)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight if self.transposed else F.linear(x, self.weight)


class SharedExperts(nn.Module):
    """``down(act(gate(x)) * up(x))`` with ``num_shared_experts * intermediate_size`` inner
    features, split over ``tp_degree`` ranks like Llama's MLP.

    ``fused_gate_up_projection``: one ``gate_up_proj.weight`` [2 * inner, hidden] (gate rows,
    then up rows) in place of ``gate_proj`` and ``up_proj``. ``transpose_weights``: every
    weight stored as [in, out] (``gate_proj.weight`` [hidden, inner]), the layout some
    checkpoints ship, multiplied as it is.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_shared_experts: int,
        hidden_act: str,
        *,
        fused_gate_up_projection: bool = False,
        transpose_weights: bool = False,
        tp_degree: int = 1,
        rank: int = 0,
        group: str = TP,
    ) -> None:
        super().__init__()
        inner = intermediate_size * num_shared_experts
        self.fused = fused_gate_up_projection
        self.tp_degree, self.group = tp_degree, group
        self.act = activation(hidden_act)
        common = {"transposed": transpose_weights, "tp_degree": tp_degree, "rank": rank}
        if self.fused:
            self.gate_up_proj = Projection(hidden_size, 2 * inner, split="out", parts=2, **common)
        else:
            self.gate_proj = Projection(hidden_size, inner, split="out", **common)
            self.up_proj = Projection(hidden_size, inner, split="out", **common)
        self.down_proj = Projection(inner, hidden_size, split="in", **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        out = self.down_proj(self.act(gate) * up)
        if use_collectives(self.tp_degree, self.group):
            out = all_reduce_sum(out, self.group)
        return out
