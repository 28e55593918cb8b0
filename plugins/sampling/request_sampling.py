"""On-device sampling for the serving engine: each request's settings as a row of the graph's
``sampling_params`` (with ``dynamic``), or checked against the settings the graph was compiled
with (without)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from nxdplug.plugin_api import PipelineContext


class RequestSampling:
    """The on-device-sampling feature's ``request_sampling``, built with the application's
    pipeline context."""

    def __init__(self, context: PipelineContext) -> None:
        neuron_config = context.neuron_config
        self.device = context.device
        self.config = neuron_config.on_device_sampling_config
        self.returns_logits = bool(neuron_config.output_logits)

    def refusal(self, settings: Any) -> tuple[str, str] | None:
        if settings.seed is not None and not settings.greedy:
            return (
                "seed",
                "seed cannot be honoured: this model samples in its graph from one random "
                "stream for every request (on_device_sampling_config); leave seed out, or "
                "serve the model without on-device sampling",
            )
        if self.config.dynamic:
            if settings.top_k > self.config.global_topk:
                return (
                    "top_k",
                    f"top_k={settings.top_k} is larger than global_topk="
                    f"{self.config.global_topk}, the candidates the model's sampler keeps",
                )
            return None
        fixed = self._fixed_row()
        asked = None if settings.greedy else self.row(settings)
        if asked == fixed:
            return None
        compiled = "greedy" if fixed is None else "top_k={:g}, top_p={:g}, temperature={:g}"
        return (
            "temperature",
            f"this model samples with the settings it was compiled with "
            f"({compiled.format(*(fixed or ()))}); per-request temperature, top_k and top_p "
            "need on_device_sampling_config.dynamic=True",
        )

    def step_keywords(self, settings: Sequence[Any]) -> dict[str, torch.Tensor]:
        if not self.config.dynamic:
            return {}
        rows = [(1.0, 1.0, 1.0) if s.greedy else self.row(s) for s in settings]
        return {"sampling_params": torch.tensor(rows, dtype=torch.float32, device=self.device)}

    def row(self, settings: Any) -> tuple[float, float, float]:
        """``(top_k, top_p, temperature)`` for the graph; top_k 0 (off) becomes the candidates
        it keeps."""
        top_k = settings.top_k or self.config.global_topk
        return (float(top_k), float(settings.top_p), float(settings.temperature))

    def _fixed_row(self) -> tuple[float, float, float] | None:
        if not self.config.do_sample:
            return None
        return (float(self.config.top_k), float(self.config.top_p), float(self.config.temperature))
