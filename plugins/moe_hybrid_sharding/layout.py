"""The experts of each MoE block held twice, once per phase layout.

A rank holds its share of the experts as context encoding lays them out and its share as token
generation lays them out (``HybridShardingConfig``: ``moe_cte_tp_degree`` x
``moe_cte_ep_degree`` and ``moe_tkg_tp_degree`` x ``moe_tkg_ep_degree``, each product the
``tp_degree``). Which copy a step uses is decided on the host from the running phase, so each
compiled graph reads only its own layout. Both layouts add their partial outputs over all
ranks, which is why the phases need no process groups of their own.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from nxdplug.plugin_api import ConfigError, ExpertMLPs, current_phase, rank_layout

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, MoENeuronConfig, PipelineContext

PHASES = ("context_encoding", "token_generation")
EXPERT_WEIGHT = re.compile(
    r"\.expert_mlps\.(gate_up_proj|down_proj|gate_up_proj_bias|down_proj_bias)$"
)


def phase_degrees(neuron_config: MoENeuronConfig) -> dict[str, tuple[int, int]]:
    """(tp, ep) degrees of the experts in each phase."""
    hybrid = neuron_config.hybrid_sharding_config
    return {
        "context_encoding": (hybrid.moe_cte_tp_degree, hybrid.moe_cte_ep_degree),
        "token_generation": (hybrid.moe_tkg_tp_degree, hybrid.moe_tkg_ep_degree),
    }


def validate(context: PipelineContext) -> Iterator[str]:
    neuron_config, config = context.neuron_config, context.config
    tp_degree = neuron_config.tp_degree
    if (neuron_config.moe_tp_degree, neuron_config.moe_ep_degree) != (1, 1):
        yield (
            "hybrid_sharding_config gives each phase its own expert degrees; leave "
            "moe_tp_degree and moe_ep_degree at 1"
        )
    for phase, (tp, ep) in phase_degrees(neuron_config).items():
        short = "cte" if phase == "context_encoding" else "tkg"
        names = f"moe_{short}_tp_degree ({tp}) x moe_{short}_ep_degree ({ep})"
        if tp < 1 or ep < 1:
            yield f"hybrid_sharding_config: {names} must both be at least 1"
        elif tp * ep != tp_degree:
            yield (
                f"hybrid_sharding_config: {names} must equal tp_degree ({tp_degree}), the ranks "
                "every phase lays its experts out over"
            )
        else:
            yield from _split_problems(config, short, tp, ep)


def _split_problems(config: InferenceConfig, short: str, tp: int, ep: int) -> Iterator[str]:
    experts = getattr(config, "num_local_experts", None)
    inner = getattr(config, "intermediate_size", None)
    if experts is not None and experts % ep:
        yield f"moe_{short}_ep_degree ({ep}) must divide the number of experts ({experts})"
    if inner is not None and inner % tp:
        yield f"moe_{short}_tp_degree ({tp}) must divide the experts' intermediate size ({inner})"


class PhaseLayoutExperts(nn.Module):
    """Routed experts with one :class:`ExpertMLPs` per phase layout: ``context_encoding`` for
    prompts, ``token_generation`` for every other phase (decode, speculation)."""

    def __init__(self, experts: ExpertMLPs, neuron_config: MoENeuronConfig) -> None:
        super().__init__()
        for phase, (tp, ep) in phase_degrees(neuron_config).items():
            degrees = rank_layout(tp, ep)
            layout = ExpertMLPs(
                experts.config,
                tp_degree=degrees.tp_degree,
                tp_rank=degrees.tp_rank,
                ep_degree=degrees.ep_degree,
                ep_rank=degrees.ep_rank,
                group=experts.group,
            )
            self.add_module(phase, layout)

    def decode_weight_bytes(self, batch_size: int, dtype: torch.dtype) -> int:
        """Decoding reads the token-generation layout only."""
        return self.token_generation.decode_weight_bytes(batch_size, dtype)

    def forward(
        self, hidden: torch.Tensor, affinities: torch.Tensor, expert_index: torch.Tensor
    ) -> torch.Tensor:
        prompts = current_phase().is_context_encoding
        experts = self.context_encoding if prompts else self.token_generation
        return experts(hidden, affinities, expert_index)


def lay_out_experts_per_phase(model: nn.Module, context: PipelineContext) -> None:
    """The ``transform_model`` callback: every MoE block's experts laid out per phase."""
    blocks = [m for m in model.modules() if isinstance(getattr(m, "expert_mlps", None), ExpertMLPs)]
    if not blocks:
        raise ConfigError(
            [f"hybrid_sharding_config is set but {type(model).__name__} has no routed experts"]
        )
    for block in blocks:
        block.expert_mlps = PhaseLayoutExperts(block.expert_mlps, context.neuron_config)


def copy_expert_weights_per_phase(
    state_dict: dict[str, torch.Tensor], config: InferenceConfig
) -> dict[str, torch.Tensor]:
    """``...expert_mlps.W`` becomes ``...expert_mlps.<phase>.W`` for both phases (the same
    tensor: each rank's shards are cut from it per layout when the weights load)."""
    converted = {}
    for key, tensor in state_dict.items():
        match = EXPERT_WEIGHT.search(key)
        if match is None:
            converted[key] = tensor
            continue
        stem = key[: match.start()]
        for phase in PHASES:
            converted[f"{stem}.expert_mlps.{phase}.{match.group(1)}"] = tensor
    return converted
