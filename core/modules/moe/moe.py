"""MoE: router, routed experts and optional shared experts as one MLP block, and
``initialize_moe_module``, which builds it from an InferenceConfig as NxD Inference's does."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import attrs
import torch
from torch import nn

from nxdplug.config import MoEFusedTKGConfig, RoutedExpertsMLPOpsConfig
from nxdplug.modules.moe.expert_mlps import ExpertMLPs
from nxdplug.modules.moe.parallel import moe_degrees
from nxdplug.modules.moe.routing import RouterTopK
from nxdplug.modules.moe.shared_experts import SharedExperts

if TYPE_CHECKING:
    from nxdplug.config import InferenceConfig, MoENeuronConfig


def fused_tkg_settings(tkg_config: MoEFusedTKGConfig | None) -> list[str]:
    """The MoEFusedTKGConfig settings that are on (``name=True``)."""
    if tkg_config is None:
        return []
    return [f"{name}=True" for name, value in attrs.asdict(tkg_config).items() if value]


class MoE(nn.Module):
    """out = experts(x; router(x)) + shared_experts(x), for x of shape [batch, seq, hidden].

    With ``rmsnorm``, x is normalized first (the decoder layer then skips its own norm). The
    output is a tuple when ``return_router_logits`` / ``return_expert_index`` ask for those too:
    (output, router logits [tokens, experts], expert index [tokens, top_k]), in that order.

    ``init_tkg_module`` / ``tkg_config`` (a MoEFusedTKGConfig) ask for NxD's fused
    token-generation module, Neuron kernels that compute this same block: here one block serves
    both phases, and kernel switches that are on are reported once as without effect.
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
        init_tkg_module: bool = False,
        tkg_config: MoEFusedTKGConfig | None = None,
    ) -> None:
        super().__init__()
        switched_on = fused_tkg_settings(tkg_config) if init_tkg_module else []
        if switched_on:
            warnings.warn(
                f"MoEFusedTKGConfig {', '.join(switched_on)}: settings of the fused "
                "token-generation module's Neuron kernels; no effect here, where one MoE block "
                "(the same result) serves both phases",
                RuntimeWarning,
                stacklevel=2,
            )
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


def without_router_outputs(out: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """An MLP block's output states: the first item of the tuple an :class:`MoE` returns when
    asked for its router logits or expert index; any other output as it is."""
    return out[0] if isinstance(out, tuple) else out


def routed_experts_config(
    config: InferenceConfig, *, bias: bool = False
) -> RoutedExpertsMLPOpsConfig:
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
    config: InferenceConfig,
    rmsnorm: nn.Module | None = None,
    init_tkg_module: bool = False,
    apply_act_fn_over_topk: bool = False,
    router_bias: bool = False,
    experts_bias: bool = False,
) -> MoE:
    """The MoE block of one decoder layer, from the model config (``num_local_experts``,
    ``num_experts_per_tok``, ``hidden_size``, ``intermediate_size``, ``hidden_act``, and
    ``n_shared_experts`` when present) and its MoENeuronConfig.

    ``init_tkg_module`` asks for NxD's fused token-generation kernel module, with a
    MoEFusedTKGConfig built from the config as NxD Inference builds it (``quantized`` and the
    ``*_nki_kernel_enabled`` switches): see :class:`MoE`.
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
        init_tkg_module=init_tkg_module,
        tkg_config=fused_tkg_config(neuron_config) if init_tkg_module else None,
    ).eval()


def fused_tkg_config(neuron_config: MoENeuronConfig) -> MoEFusedTKGConfig:
    """NxD Inference's MoEFusedTKGConfig of a MoENeuronConfig: ``quantized`` and its
    ``moe_fused_nki_kernel_enabled``, ``router_topk_nki_kernel_enabled``,
    ``expert_mlp_nki_kernel_enabled`` and ``shared_mlp_nki_kernel_enabled`` keywords."""
    return MoEFusedTKGConfig(
        quantized=bool(neuron_config.quantized),
        moe_fused_kernel_enabled=getattr(neuron_config, "moe_fused_nki_kernel_enabled", None),
        router_topk_kernel_enabled=getattr(neuron_config, "router_topk_nki_kernel_enabled", None),
        expert_mlp_kernel_enabled=getattr(neuron_config, "expert_mlp_nki_kernel_enabled", None),
        shared_mlp_kernel_enabled=getattr(neuron_config, "shared_mlp_nki_kernel_enabled", None),
    )
