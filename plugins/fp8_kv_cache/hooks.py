"""KV-cache quantization (``kv_cache_quant=True``): the cache stored as float8_e4m3fn.

The ``fp8`` KV-cache strategy replaces ``static`` when ``kv_cache_quant`` is set; the
``fp8-kv-cache`` feature owns its two settings, ``kv_cache_scales`` (``None``: scale 1) and
``kv_cache_scale_granularity`` (``per_tensor`` or ``per_head``). Scales come from
:func:`nxdplug.plugins.fp8_kv_cache.calibration.calibrate_kv_cache_scales`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from nxdplug.hookspecs import hookimpl
from nxdplug.plugins.fp8_kv_cache.scales import (
    DEFAULT_GRANULARITY,
    GRANULARITY,
    SCALES,
    scale_problems,
)
from nxdplug.types import Feature, KVCacheStrategy

if TYPE_CHECKING:
    from torch import nn

    from nxdplug.config import InferenceConfig

NXDPLUG_API_VERSION = 1

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
        description="K/V scales of the fp8 KV cache, per tensor or per K/V head",
    )


@hookimpl
def nxdplug_validate_config(config: InferenceConfig) -> Iterable[str]:
    """The scale settings against the model's layers and K/V heads.

    NxD Inference also asks for ``XLA_HANDLE_SPECIAL_SCALAR=1`` with ``kv_cache_quant``; that
    is a Neuron (XLA) runtime setting, so it is not required here on the CPU: checking it
    belongs to the neuron backend plugin.
    """
    from nxdplug.errors import ConfigError
    from nxdplug.modules.attention import attention_head_counts

    scales = getattr(config.neuron_config, SCALES, None)
    granularity = getattr(config.neuron_config, GRANULARITY, DEFAULT_GRANULARITY)
    try:
        num_kv_heads = attention_head_counts(config)[1]
    except ConfigError:  # the head counts themselves are wrong: the core rules report that
        return scale_problems(None, granularity, 0, 0)
    return scale_problems(scales, granularity, config.num_hidden_layers, num_kv_heads)


@hookimpl
def nxdplug_transform_model(model: nn.Module, config: InferenceConfig) -> None:
    """Put the config's scales into the model's fp8 cache (it starts with scale 1)."""
    from nxdplug.errors import NotSupportedError
    from nxdplug.plugins.fp8_kv_cache.cache import Fp8KVCache, scale_table

    scales = getattr(config.neuron_config, SCALES, None)
    kv_mgr = getattr(model, "kv_mgr", None)
    if scales is None or kv_mgr is None:
        return
    if not isinstance(kv_mgr, Fp8KVCache):
        raise NotSupportedError(
            f"{SCALES} is set but {type(model).__name__} built a {type(kv_mgr).__name__} "
            "cache rather than the fp8 one kv_cache_quant selects; unset kv_cache_scales"
        )
    heads = kv_mgr.layout.num_kv_heads
    kv_mgr.set_scales(scale_table(scales["k"], heads), scale_table(scales["v"], heads))
