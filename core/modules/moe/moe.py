"""MoE: router, routed experts and optional shared experts as one MLP block, and
``initialize_moe_module``, which builds it from an InferenceConfig as NxD Inference's does."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nxdplug.config import RoutedExpertsMLPOpsConfig
from nxdplug.modules.moe.expert_mlps import ExpertMLPs
from nxdplug.modules.moe.parallel import moe_degrees
from nxdplug.modules.moe.routing import RouterTopK
from nxdplug.modules.moe.shared_experts import SharedExperts


class MoE(nn.Module):
    """out = experts(x; router(x)) + shared_experts(x), for x of shape [batch, seq, hidden].

    With ``rmsnorm``, x is normalized first (the decoder layer then skips its own norm). The
    output is a tuple when ``return_router_logits`` / ``return_expert_index`` ask for those too:
    (output, router logits [tokens, experts], expert index [tokens, top_k]), in that order.
    """

    def __init__(
        self,
        router: RouterTopK,
        expert_mlps: ExpertMLPs,
        shared_experts: SharedExperts | None = None,
        rmsnorm: nn.Module | None = None,
        *,
        return_router_logits: bool = False,
        return_expert_index: bool = False,
    ) -> None:
        super().__init__()
        self.router = router
        self.expert_mlps = expert_mlps
        self.shared_experts = shared_experts
        self.rmsnorm = rmsnorm
        self.return_router_logits = return_router_logits
        self.return_expert_index = return_expert_index

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.rmsnorm is not None:
            hidden_states = self.rmsnorm(hidden_states)
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        router_logits, affinities, expert_index = self.router(tokens)
        out = self.expert_mlps(tokens, affinities, expert_index)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        out = out.view_as(hidden_states)
        extras = [router_logits] if self.return_router_logits else []
        extras += [expert_index] if self.return_expert_index else []
        return (out, *extras) if extras else out


def routed_experts_config(config: Any, *, bias: bool = False) -> RoutedExpertsMLPOpsConfig:
    """The routed experts' settings: shapes from the model config (HF names), numerics from
    its MoENeuronConfig."""
    neuron_config = config.neuron_config
    return RoutedExpertsMLPOpsConfig(
        num_experts=config.num_local_experts,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        top_k=config.num_experts_per_tok,
        hidden_act=config.hidden_act,
        glu_mlp=neuron_config.glu_mlp,
        bias=bias,
        glu_type=neuron_config.glu_type,
        hidden_act_scaling_factor=neuron_config.hidden_act_scaling_factor,
        hidden_act_bias=neuron_config.hidden_act_bias,
        capacity_factor=neuron_config.capacity_factor,
        use_index_calc_kernel=neuron_config.use_index_calc_kernel,
        gate_clamp_upper_limit=neuron_config.gate_clamp_upper_limit,
        gate_clamp_lower_limit=neuron_config.gate_clamp_lower_limit,
        up_clamp_upper_limit=neuron_config.up_clamp_upper_limit,
        up_clamp_lower_limit=neuron_config.up_clamp_lower_limit,
        normalize_top_k_affinities=neuron_config.normalize_top_k_affinities,
        early_expert_affinity_modulation=neuron_config.early_expert_affinity_modulation,
    )


def initialize_moe_module(
    config: Any,
    rmsnorm: nn.Module | None = None,
    init_tkg_module: bool = False,
    apply_act_fn_over_topk: bool = False,
    router_bias: bool = False,
    experts_bias: bool = False,
) -> MoE:
    """The MoE block of one decoder layer, from the model config (``num_local_experts``,
    ``num_experts_per_tok``, ``hidden_size``, ``intermediate_size``, ``hidden_act``, and
    ``n_shared_experts`` when present) and its MoENeuronConfig.

    ``init_tkg_module`` asks for NxD's fused token-generation kernel module, which exists on
    Neuron only; here the same block serves both phases, so it has no effect.
    """
    neuron_config = config.neuron_config
    degrees = moe_degrees(neuron_config)
    router_config = neuron_config.router_config
    router = RouterTopK(
        config.num_local_experts,
        config.num_experts_per_tok,
        config.hidden_size,
        act_fn=router_config.act_fn,
        dtype=router_config.dtype,
        bias=router_bias,
        apply_act_fn_over_topk=apply_act_fn_over_topk,
    )
    expert_mlps = ExpertMLPs(
        routed_experts_config(config, bias=experts_bias),
        tp_degree=degrees.tp_degree,
        tp_rank=degrees.tp_rank,
        ep_degree=degrees.ep_degree,
        ep_rank=degrees.ep_rank,
        group=degrees.group,
    )
    shared_experts = None
    if getattr(config, "n_shared_experts", 0):
        shared_experts = SharedExperts(
            config.hidden_size,
            config.intermediate_size,
            config.n_shared_experts,
            config.hidden_act,
            fused_gate_up_projection=neuron_config.fused_shared_experts,
            transpose_weights=neuron_config.transpose_shared_experts_weights,
            tp_degree=degrees.world,
            rank=degrees.rank,
            group=degrees.group,
        )
    return MoE(
        router,
        expert_mlps,
        shared_experts,
        rmsnorm,
        return_router_logits=neuron_config.return_router_logits,
        return_expert_index=neuron_config.return_expert_index,
    ).eval()
