"""Attention over a KV cache whose positions are dealt out over the ranks of a group.

Of ``size`` ranks sharing a K/V head, rank ``rank`` holds positions ``rank, rank + size, ...``:
position ``p`` at slot ``p // size`` of rank ``p % size``. Every rank computes the group's query
heads against the keys it holds and keeps, per query, the largest score ``m``, the sum
``l = sum exp(s - m)`` and ``o = sum exp(s - m) v``. Rescaled to the largest ``m`` of the group
(``M``), the ranks' sums add up to the full softmax: ``sum_r exp(m_r - M) o_r / sum_r
exp(m_r - M) l_r``, exactly, in float32.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from nxdplug.plugin_api import CacheSlot, all_gather

GROUP = "kv"


def held_length(length: int, size: int) -> int:
    """Slots one rank of ``size`` needs for ``length`` positions (the first rank's count)."""
    return -(-length // size)


def held_slots(position_ids: torch.Tensor, rank: int, size: int, spare_slot: int) -> torch.Tensor:
    """This rank's cache slot for each position; positions other ranks hold go to
    ``spare_slot``, a slot past every one that is read."""
    return torch.where(position_ids % size == rank, position_ids // size, spare_slot)


def held_mask(mask: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The key columns of ``mask`` [..., keys] for the positions this rank holds, in slot
    order, up to ``held_length(keys, size)`` slots (a slot past the last key: False)."""
    keys = mask.shape[-1]
    positions = rank + size * torch.arange(held_length(keys, size), device=mask.device)
    columns = mask.index_select(-1, positions.clamp(max=keys - 1))
    return columns & (positions < keys)


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """One rank's share of softmax(q k^T / sqrt(d)) v: ``o``, ``m`` and ``l`` (see the module
    docstring) packed as [batch, heads, queries, head_dim + 2], float32.

    q: [batch, heads, queries, dim]; k, v: [batch, 1, keys, dim], the one K/V head all these
    query heads share; mask: boolean [batch, 1, queries, keys]. A query that sees none of these
    keys gets ``m`` = float32's lowest, so the merge weighs its share by zero.
    """
    dim = q.shape[-1]
    scores = (q.float() @ k.float().transpose(-1, -2)) * dim**-0.5
    scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    peak = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - peak)
    return torch.cat([weights @ v.float(), peak, weights.sum(dim=-1, keepdim=True)], dim=-1)


def merge_partials(partials: torch.Tensor) -> torch.Tensor:
    """The attention output from the ranks' :func:`partial_attention` stacked along dim 0:
    [ranks, batch, heads, queries, dim + 2] -> [batch, heads, queries, dim]."""
    values, peaks, totals = partials[..., :-2], partials[..., -2:-1], partials[..., -1:]
    scale = torch.exp(peaks - peaks.amax(dim=0))
    return (values * scale).sum(dim=0) / (totals * scale).sum(dim=0)


@attrs.frozen
class SequenceSplitAttention:
    """An attention module's ``cache_attention`` on rank ``rank`` of a ``kv`` group of
    ``size``: store the positions this rank holds, gather the group's queries, attend over the
    held keys, merge the group's partial results, keep this rank's query heads."""

    rank: int
    size: int
    spare_slot: int

    def __call__(
        self,
        attention: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        cache: CacheSlot,
    ) -> torch.Tensor:
        slots = held_slots(cache.position_ids, self.rank, self.size, self.spare_slot)
        held = attrs.evolve(cache, position_ids=slots, length=held_length(cache.length, self.size))
        k, v = held.store_and_fetch(k, v)
        dtype = attention.attention_dtype or q.dtype
        group_q = all_gather(q.to(dtype), 1, self.rank, self.size, GROUP)
        mine = partial_attention(
            group_q, k.to(dtype), v.to(dtype), held_mask(mask, self.rank, self.size)
        )
        partials = all_gather(mine.unsqueeze(0), 0, self.rank, self.size, GROUP)
        heads = q.shape[1]
        return merge_partials(partials).narrow(1, self.rank * heads, heads)
