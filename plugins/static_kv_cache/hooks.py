"""The default KV cache: one static BHSD buffer per layer, updated in place."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import KVCacheStrategy, hookimpl

NXDPLUG_API_VERSION = 2


@hookimpl
def nxdplug_kv_cache_strategies() -> Iterable[KVCacheStrategy]:
    yield KVCacheStrategy(
        name="static",
        implementation="nxdplug.plugins.static_kv_cache.cache:StaticKVCache",
        description="[batch, kv_heads, seq_len, head_dim] per layer, written by position",
    )
