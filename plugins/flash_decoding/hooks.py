"""Flash decoding: when tensor parallelism replicates each K/V head over several ranks, those
ranks hold its cache positions in turn instead of a copy each."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import Feature, ParallelGroup, hookimpl

NXDPLUG_API_VERSION = 2

MODULE = "nxdplug.plugins.flash_decoding.layout"


@hookimpl
def nxdplug_features() -> Iterable[Feature]:
    yield Feature(
        name="flash-decoding",
        enabled_by=("flash_decoding_enabled",),
        validate=f"{MODULE}:validate",
        transform_model=f"{MODULE}:split_cache_over_kv_groups",
        description="KV cache positions split over the ranks sharing a K/V head, partial "
        "attention merged by log-sum-exp",
    )


@hookimpl
def nxdplug_parallel_groups() -> Iterable[ParallelGroup]:
    yield ParallelGroup(
        name="kv",
        partition=f"{MODULE}:ranks_sharing_a_kv_head",
        enabled_by=("flash_decoding_enabled",),
        description="the ranks whose query heads share one K/V head",
    )
