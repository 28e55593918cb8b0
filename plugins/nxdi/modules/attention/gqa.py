"""NxD Inference's ``modules.attention.gqa``: how attention heads are laid out over the
tensor-parallel ranks (the strategies and head counts; the tensor-rearranging helpers are
nxdplug's own, in :mod:`nxdplug.modules.gqa`)."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(
    __name__,
    {
        "GQA": "nxdplug.config.head_sharding:GQA",
        "determine_sharding_strategy": "nxdplug.config.head_sharding:determine_sharding_strategy",
        "get_shardable_head_counts": "nxdplug.config.head_sharding:shardable_head_counts",
    },
)
