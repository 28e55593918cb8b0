"""MoE hybrid sharding (``hybrid_sharding_config``): each phase lays the routed experts out over
the ranks its own way (tensor- and expert-parallel degrees per phase), while attention, its
weights and the KV cache stay as tensor parallelism lays them out, shared by the phases."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import Feature, StateDictConverter, hookimpl

NXDPLUG_API_VERSION = 2

MODULE = "nxdplug.plugins.moe_hybrid_sharding.layout"


@hookimpl
def nxdplug_features() -> Iterable[Feature]:
    yield Feature(
        name="moe-hybrid-sharding",
        enabled_by=("hybrid_sharding_config",),
        validate=f"{MODULE}:validate",
        transform_model=f"{MODULE}:lay_out_experts_per_phase",
        description="separate tp/ep degrees for the experts of context encoding and of "
        "token generation",
    )


@hookimpl
def nxdplug_state_dict_converters() -> Iterable[StateDictConverter]:
    yield StateDictConverter(
        name="moe-hybrid-sharding",
        converter=f"{MODULE}:copy_expert_weights_per_phase",
        enabled_by=("hybrid_sharding_config",),
        order=150,
        description="every expert weight once per phase layout",
    )
