"""QKV weight fusion (``fused_qkv=True``): one projection instead of three."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.hookspecs import hookimpl
from nxdplug.types import Feature, StateDictConverter

NXDPLUG_API_VERSION = 1


@hookimpl
def nxdplug_features() -> Iterable[Feature]:
    yield Feature(
        name="fused-qkv",
        enabled_by=("fused_qkv",),
        description="concatenate the Q, K and V projections into one matrix",
    )


@hookimpl
def nxdplug_state_dict_converters() -> Iterable[StateDictConverter]:
    yield StateDictConverter(
        name="fused-qkv",
        converter="nxdplug.plugins.fused_qkv.convert:fuse_qkv_projections",
        enabled_by=("fused_qkv",),
        order=120,
        description="q_proj, k_proj, v_proj -> qkv_proj",
    )
