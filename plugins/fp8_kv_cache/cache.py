"""The fp8 KV cache: the static BHSD layout stored as float8_e4m3fn, with per-head scales.

Per layer, K and V buffers of [max_batch, kv_heads, seq_len, head_dim] in float8_e4m3fn (one
byte per value: half of bfloat16, a quarter of float32), plus two [layers, kv_heads] float32
scale buffers. The scales are buffers of this module, not constants, because a compiled graph
takes every cache buffer as an input: the graph stays the same whatever the scales, and the
values come from the config (``kv_cache_scales``) when the model is built.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nxdplug.plugin_api import CacheLayout, KVCacheManager, read_prefix, write_positions

if TYPE_CHECKING:
    from nxdplug.plugin_api import PipelineContext

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: e4m3fn has no infinity


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``saturate(x / scale)`` in float8_e4m3fn.

    The clamp makes the cast saturating on every backend: e4m3fn has no infinity, and a cast
    of an out-of-range value is not guaranteed to stop at ±448 (it may give NaN).
    """
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``stored * scale`` in ``dtype``, multiplied in float32 so ``dtype`` rounds only once."""
    return (stored.float() * scale).to(dtype)


class Fp8KVCache(KVCacheManager):
    """Keys and values stored as ``saturate(x / scale)`` in fp8, read back as ``fp8 * scale``
    in the keys' dtype; the scales are 1 until :meth:`set_scales` (the plugin's
    ``transform_model`` callback sets those of the config)."""

    def __init__(self, layout: CacheLayout) -> None:
        super().__init__(layout)
        shape = (layout.max_batch_size, layout.num_kv_heads, layout.max_length, layout.head_dim)
        for layer in range(layout.num_layers):
            self.register_buffer(f"k_{layer}", torch.zeros(shape, dtype=FP8), False)
            self.register_buffer(f"v_{layer}", torch.zeros(shape, dtype=FP8), False)
        scales = torch.ones(layout.num_layers, layout.num_kv_heads, dtype=torch.float32)
        self.register_buffer("k_scales", scales, False)
        self.register_buffer("v_scales", scales.clone(), False)

    def set_scales(self, k_scales: torch.Tensor, v_scales: torch.Tensor) -> None:
        """Use these [layers, kv_heads] scales for K and V from now on."""
        for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
            target = getattr(self, name)
            if scales.shape != target.shape:
                raise ValueError(
                    f"{name} must have shape {tuple(target.shape)} (layers, K/V heads of this "
                    f"cache); got {tuple(scales.shape)}"
                )
            target.copy_(scales)

    def update_and_read(
        self,
        layer: int,
        key: torch.Tensor,
        value: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor,
        length: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache, v_cache = getattr(self, f"k_{layer}"), getattr(self, f"v_{layer}")
        k_scale, v_scale = self.k_scales[layer], self.v_scales[layer]
        per_head_k, per_head_v = k_scale[:, None, None], v_scale[:, None, None]
        write_positions(k_cache, seq_ids, position_ids, quantize(key, per_head_k))
        write_positions(v_cache, seq_ids, position_ids, quantize(value, per_head_v))
        keys = dequantize(read_prefix(k_cache, seq_ids, length), per_head_k, key.dtype)
        values = dequantize(read_prefix(v_cache, seq_ids, length), per_head_v, value.dtype)
        # This step's own keys and values are used as computed, the earlier ones as stored: as in
        # NxD Inference, only what comes back from the cache is quantized. Every position is
        # below ``length``, since a query must see its own key.
        batch = torch.arange(key.shape[0], device=key.device)[:, None]
        keys[batch, :, position_ids] = key.transpose(1, 2)
        values[batch, :, position_ids] = value.transpose(1, 2)
        return keys, values

    def reset(self) -> None:
        for layer in range(self.layout.num_layers):
            getattr(self, f"k_{layer}").zero_()
            getattr(self, f"v_{layer}").zero_()


def scale_table(per_layer: Sequence[Any], num_heads: int) -> torch.Tensor:
    """[layers, heads] float32 scales from one tensor's config entry (numbers or lists)."""
    rows = [
        [float(entry)] * num_heads if isinstance(entry, numbers.Real) else [float(v) for v in entry]
        for entry in per_layer
    ]
    return torch.tensor(rows, dtype=torch.float32)


def cache_bytes(kv_mgr: nn.Module) -> int:
    """Bytes held by a KV-cache manager's buffers: keys, values and any scales."""
    return sum(buffer.numel() * buffer.element_size() for buffer in kv_mgr.buffers())


def apply_config_scales(model: nn.Module, context: PipelineContext) -> None:
    """The ``transform_model`` callback: the config's scales into the model's fp8 cache (it
    starts with scale 1)."""
    from nxdplug.plugin_api import NotSupportedError
    from nxdplug.plugins.fp8_kv_cache.scales import SCALES

    scales = getattr(context.neuron_config, SCALES, None)
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
