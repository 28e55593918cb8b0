"""Async mode's loop: the model's next step starts before the host handles the last one.

When the model chooses its tokens (on-device sampling), step n+1's inputs are step n's tokens,
known as soon as step n returns. With ``async_mode`` the next call runs on a worker thread while
the host checks stop conditions, feeds streamers and keeps scores; the model's kernels release
the GIL, so the two overlap. A sequence that ends lets one extra step run; it is waited for and
dropped, so the caches are never written behind the caller's back.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class StepAhead:
    """Runs ``call(input_ids, attention_mask)``: at once, or ahead on a worker thread."""

    def __init__(self, call: Callable[[torch.Tensor, torch.Tensor], Any], pipelined: bool) -> None:
        self.call = call
        self.worker = ThreadPoolExecutor(1, "nxdplug-step") if pipelined else None
        self.pending: Future[Any] | None = None

    def outputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        """This step's outputs: the call started ahead, else one made now."""
        if self.pending is None:
            return self.call(input_ids, attention_mask)
        pending, self.pending = self.pending, None
        return pending.result()

    def start_next(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Start the next step now (async mode); without it, the next ``outputs`` call runs it."""
        if self.worker is None:
            return

        def run() -> Any:
            with torch.inference_mode():
                return self.call(input_ids, attention_mask)

        self.pending = self.worker.submit(run)

    def finish(self) -> None:
        """Wait for a step started ahead that is no longer needed, and stop the worker."""
        if self.pending is not None:
            self.pending.result()
            self.pending = None
        if self.worker is not None:
            self.worker.shutdown(wait=True)
