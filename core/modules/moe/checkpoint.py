"""Checkpoint helpers for model plugins: HF checkpoints keep one tensor per expert, the
building blocks one stacked tensor per layer."""

from __future__ import annotations

import torch


def pop_stacked(state_dict: dict[str, torch.Tensor], key: str, num_experts: int) -> torch.Tensor:
    """Remove ``key.format(e)`` for every expert ``e`` from ``state_dict``; return them stacked
    along a new first dim (expert order)."""
    return torch.stack([state_dict.pop(key.format(e)) for e in range(num_experts)])


def stack_gated_experts(
    state_dict: dict[str, torch.Tensor],
    *,
    gate: str,
    up: str,
    down: str,
    num_experts: int,
    target: str,
) -> None:
    """Replace per-expert gate/up/down weights (keys with ``{}`` for the expert number) by
    ``{target}.gate_up_proj`` [experts, 2 * inner, hidden] and ``{target}.down_proj``
    [experts, hidden, inner], as :class:`~nxdplug.modules.moe.ExpertMLPs` holds them."""
    gate_up = [pop_stacked(state_dict, key, num_experts) for key in (gate, up)]
    state_dict[f"{target}.gate_up_proj"] = torch.cat(gate_up, dim=1)
    state_dict[f"{target}.down_proj"] = pop_stacked(state_dict, down, num_experts)
