"""Calibration of fp8 KV-cache scales: run prompts through the model with the unquantized
cache, record the absolute maxima of K and V per layer (and per K/V head), scale = amax / 448.

Usage::

    settings = calibrate_kv_cache_scales(model_path, prompts, granularity="per_head")
    neuron_config = NeuronConfig(kv_cache_quant=True, **settings)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nxdplug.plugin_api import KVCacheManager
from nxdplug.plugins.fp8_kv_cache.cache import FP8_MAX
from nxdplug.plugins.fp8_kv_cache.scales import GRANULARITIES, GRANULARITY, SCALES

if TYPE_CHECKING:
    from nxdplug.plugin_api import NeuronConfig


class AbsMaxObserver(KVCacheManager):
    """Wraps a cache and records, per layer and K/V head, the largest |K| and |V| stored.

    It sees every token written, padding included, so calibration feeds it unpadded batches.
    """

    def __init__(self, inner: KVCacheManager) -> None:
        super().__init__(inner.layout)
        self.inner = inner
        shape = (inner.layout.num_layers, inner.layout.num_kv_heads)
        self.k_amax = torch.zeros(shape, dtype=torch.float32)
        self.v_amax = torch.zeros(shape, dtype=torch.float32)

    def update_and_read(
        self,
        layer: int,
        key: torch.Tensor,
        value: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor,
        length: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for amax, new in ((self.k_amax, key), (self.v_amax, value)):
            amax[layer] = torch.maximum(amax[layer], new.abs().amax(dim=(0, 2, 3)).float())
        return self.inner.update_and_read(layer, key, value, position_ids, seq_ids, length)

    def reset(self) -> None:
        self.inner.reset()


def _scales(amax: torch.Tensor, granularity: str) -> list[Any]:
    if granularity == "per_tensor":
        amax = amax.amax(dim=1)
    # A head that never saw a non-zero value keeps scale 1 (a zero scale is invalid).
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return scales.tolist()


def calibrate_kv_cache_scales(
    model_path: str | Path,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    *,
    granularity: str = "per_tensor",
    neuron_config: NeuronConfig | None = None,
) -> dict[str, Any]:
    """The NeuronConfig settings (``kv_cache_scales`` and ``kv_cache_scale_granularity``) that
    map the K/V ranges these prompts produce onto float8_e4m3fn's ±448.

    ``prompts`` are unpadded token-id sequences (lengths may differ). The model runs with the
    unquantized cache in ``neuron_config``'s ``torch_dtype`` and ``tp_degree`` (the checkpoint's
    dtype and 1 by default), one prompt at a time with a context bucket per prompt length, so no
    padding token reaches the maxima.
    """
    from nxdplug.plugin_api import NeuronConfig, from_pretrained

    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {granularity!r}")
    sequences = [torch.as_tensor(prompt, dtype=torch.long).reshape(1, -1) for prompt in prompts]
    if not sequences or min(s.shape[1] for s in sequences) == 0:
        raise ValueError("calibration needs at least one prompt, and no empty prompt")
    lengths = sorted({s.shape[1] for s in sequences})
    options: dict[str, Any] = {}
    if neuron_config is not None:
        options = {"torch_dtype": neuron_config.torch_dtype, "tp_degree": neuron_config.tp_degree}
    app = from_pretrained(
        model_path,
        NeuronConfig(
            batch_size=1,
            seq_len=lengths[-1],
            enable_bucketing=True,
            context_encoding_buckets=lengths,
            token_generation_buckets=[lengths[-1]],
            **options,
        ),
    )
    app.to_cpu()
    model = app.context_encoding_model.model
    observer = AbsMaxObserver(model.kv_mgr)
    model.kv_mgr = observer
    with torch.inference_mode():
        for input_ids in sequences:
            app.reset()
            app(input_ids=input_ids)
    return {
        SCALES: {
            "k": _scales(observer.k_amax, granularity),
            "v": _scales(observer.v_amax, granularity),
        },
        GRANULARITY: granularity,
    }
