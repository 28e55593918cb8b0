"""Mixture-of-experts building blocks (NxD's ``RouterTopK``, ``ExpertMLPs``, ``MoE``,
``SharedExperts`` and NxD Inference's ``initialize_moe_module``) for model plugins."""

from nxdplug.modules.moe.expert_mlps import ExpertMLPs
from nxdplug.modules.moe.moe import MoE, initialize_moe_module, without_router_outputs
from nxdplug.modules.moe.routing import RouterTopK
from nxdplug.modules.moe.shared_experts import SharedExperts

__all__ = [
    "ExpertMLPs",
    "MoE",
    "RouterTopK",
    "SharedExperts",
    "initialize_moe_module",
    "without_router_outputs",
]
