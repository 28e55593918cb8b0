"""RouterTopK: which experts each token goes to, and with what affinity."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nxdplug.config.moe import ROUTER_ACTIVATIONS
from nxdplug.errors import ConfigError


class RouterTopK(nn.Module):
    """logits = x W_r^T (+ b); affinities = act(logits) over all experts; the k largest
    affinities pick the experts.

    The logits are computed in ``dtype`` (NxD Inference's ``RouterConfig.dtype``, float32 by
    default) whatever the model's dtype, the affinities in float32 (HF transformers' models do
    the same, with the logits in the model's dtype). ``apply_act_fn_over_topk`` takes the
    activation over the k chosen logits only (the other affinities are zero), as some
    checkpoints were trained.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        *,
        act_fn: str = "softmax",
        dtype: torch.dtype = torch.float32,
        bias: bool = False,
        apply_act_fn_over_topk: bool = False,
    ) -> None:
        super().__init__()
        if act_fn not in ROUTER_ACTIVATIONS:
            raise ConfigError(
                [f"router_config.act_fn is {act_fn!r}; expected one of {ROUTER_ACTIVATIONS}"]
            )
        if not 0 < top_k <= num_experts:
            raise ConfigError(
                [f"top_k ({top_k}) must be between 1 and num_experts ({num_experts})"]
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.act_fn = act_fn
        self.dtype = dtype
        self.apply_act_fn_over_topk = apply_act_fn_over_topk
        self.linear_router = nn.Linear(hidden_size, num_experts, bias=bias)

    def activation(self, logits: torch.Tensor) -> torch.Tensor:
        if self.act_fn == "softmax":
            return F.softmax(logits, dim=-1)
        return torch.sigmoid(logits)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [tokens, hidden]. Returns router logits [tokens, experts] in ``dtype``, float32
        affinities [tokens, experts] and the chosen experts [tokens, top_k], best first."""
        weight = self.linear_router.weight.to(self.dtype)
        bias = self.linear_router.bias
        logits = F.linear(x.to(self.dtype), weight, None if bias is None else bias.to(self.dtype))
        if self.apply_act_fn_over_topk:
            top_logits, expert_index = torch.topk(logits.float(), self.top_k, dim=-1)
            affinities = torch.zeros_like(logits, dtype=torch.float32).scatter(
                -1, expert_index, self.activation(top_logits)
            )
        else:
            affinities = self.activation(logits.float())
            expert_index = torch.topk(affinities, self.top_k, dim=-1).indices
        return logits, affinities, expert_index
