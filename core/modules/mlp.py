"""The gated MLP of Llama-style decoders: down(act(gate(x)) * up(x))."""

from __future__ import annotations

import torch
from torch import nn

from nxdplug.modules.activations import activation
from nxdplug.modules.parallel_linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    tp_rank,
    tp_world_size,
)


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        *,
        bias: bool = False,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp = {"tp_degree": tp_world_size(), "rank": tp_rank()}
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, **tp)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, **tp)
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, reduce_dtype=reduce_dtype, **tp
        )
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
