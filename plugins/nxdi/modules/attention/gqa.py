"""NxD Inference's ``modules.attention.gqa``: how attention heads are laid out over the
tensor-parallel ranks (the strategies and head counts; the tensor-rearranging helpers are
nxdplug's own, in :mod:`nxdplug.modules.gqa`)."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(
    __name__,
    {
        "GQA": "nxdplug.modules.gqa:GQA",
        "determine_sharding_strategy": "nxdplug.modules.gqa:determine_sharding_strategy",
        "get_shardable_head_counts": "nxdplug.modules.gqa:shardable_head_counts",
    },
)
