"""``nxdplug::grouped_linear``: rows grouped by expert, each group times its own weight.

The rows of ``x`` come sorted by expert: the first ``counts[0]`` rows go through ``weight[0]``,
the next ``counts[1]`` through ``weight[1]``, and so on; rows past ``counts.sum()`` (tokens a
capacity limit dropped, or routed to another rank's experts) come out as zeros. Only the weights
of experts that got rows are read, so a decode step with two routed experts reads two experts'
weights, and a prompt's tokens are multiplied expert by expert without padding.

It is a custom op for the same reason as ``nxdplug::all_reduce_sum``: how many rows each expert
gets is known only when the graph runs, so the loop over experts cannot be traced into a graph
with static shapes. torch.export records the op as one node with a fixed output shape and a
compiled graph calls back into it. (``torch._grouped_mm`` does this natively but, with torch 2.13,
traces only in bfloat16.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("nxdplug::grouped_linear", mutates_args=())
def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [rows, in] sorted by group; weight: [groups, out, in]; counts: [groups] integers;
    bias: [groups, out] or None. Returns [rows, out]."""
    out = x.new_zeros(x.shape[0], weight.shape[1])
    start = 0
    for group, count in enumerate(counts.tolist()):
        if count:
            rows = slice(start, start + count)
            out[rows] = F.linear(x[rows], weight[group], None if bias is None else bias[group])
            start += count
    return out


@grouped_linear.register_fake
def _grouped_linear_shape(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1])
