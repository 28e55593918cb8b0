"""QKV weight fusion (``fused_qkv=True``): one projection instead of three."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import Feature, StateDictConverter, hookimpl

NXDPLUG_API_VERSION = 2


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
