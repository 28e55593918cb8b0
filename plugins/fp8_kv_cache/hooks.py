"""KV-cache quantization (``kv_cache_quant=True``): the cache stored as float8_e4m3fn.

The ``fp8`` KV-cache strategy replaces ``static`` when ``kv_cache_quant`` is set; the
``fp8-kv-cache`` feature owns its two settings, ``kv_cache_scales`` (``None``: scale 1) and
``kv_cache_scale_granularity`` (``per_tensor`` or ``per_head``). Scales come from
:func:`nxdplug.plugins.fp8_kv_cache.calibration.calibrate_kv_cache_scales`.
"""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import CliExtension, Feature, KVCacheStrategy, hookimpl
from nxdplug.plugins.fp8_kv_cache.scales import DEFAULT_GRANULARITY, GRANULARITY, SCALES

NXDPLUG_API_VERSION = 2

ENABLED_BY = ("kv_cache_quant",)


@hookimpl
def nxdplug_kv_cache_strategies() -> Iterable[KVCacheStrategy]:
    yield KVCacheStrategy(
        name="fp8",
        implementation="nxdplug.plugins.fp8_kv_cache.cache:Fp8KVCache",
        enabled_by=ENABLED_BY,
        description="static BHSD layout stored as float8_e4m3fn, dequantized to torch_dtype",
    )


@hookimpl
def nxdplug_features() -> Iterable[Feature]:
    yield Feature(
        name="fp8-kv-cache",
        enabled_by=ENABLED_BY,
        settings={SCALES: None, GRANULARITY: DEFAULT_GRANULARITY},
        validate="nxdplug.plugins.fp8_kv_cache.scales:validate",
        transform_model="nxdplug.plugins.fp8_kv_cache.cache:apply_config_scales",
        description="K/V scales of the fp8 KV cache, per tensor or per K/V head",
    )


@hookimpl
def nxdplug_cli_extensions() -> Iterable[CliExtension]:
    yield CliExtension(
        name="fp8-kv-cache-inference-demo",
        implementation="nxdplug.plugins.fp8_kv_cache.demo_flags:Fp8KvCacheDemoFlags",
        commands=("inference_demo",),
        description="inference_demo's KV-cache quantization flags (--kv-quant-dtype, ...)",
    )
