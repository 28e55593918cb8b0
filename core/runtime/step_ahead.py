"""Async mode's overlap: the host handles step n while the model runs step n+1.

When the model chooses its tokens (on-device sampling), step n+1's inputs are step n's tokens,
known as soon as step n returns. With ``async_mode`` the host's work of step n (stop checks,
streamers, text, scores) runs on a helper thread while the model's step n+1 runs on the calling
thread; the model's kernels release the GIL, so the two overlap. A sequence that ends lets one
extra step run, whose outputs are dropped: the caches are never written behind the caller's back.

The model stays on the calling thread, the one that loaded it, because of OpenMP: every thread
that runs parallel kernels keeps its own team of worker threads, and once two teams together
have more threads than the machine has cores, each kernel's workers go to sleep between kernels
instead of spinning and every kernel waits for them to wake. Measured on the 2-core machine: a
16-row decode step of the ~120M Llama took 10.1 ms on the thread that loaded it and 16.7-20.1 ms
on a second thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

HostResult = TypeVar("HostResult")
ModelResult = TypeVar("ModelResult")


class HostOverlap:
    """Runs the host's work of a step on a helper thread while the next model step runs here;
    without ``enabled`` (async mode off) there is no helper and callers step one after the
    other."""

    def __init__(self, enabled: bool) -> None:
        self._helper = ThreadPoolExecutor(1, "nxdplug-host") if enabled else None

    @property
    def enabled(self) -> bool:
        return self._helper is not None

    def run(
        self, host_work: Callable[[], HostResult], model_step: Callable[[], ModelResult]
    ) -> tuple[HostResult, ModelResult]:
        """``host_work()`` on the helper while ``model_step()`` runs on this thread; both
        results, once both are done (an exception of either is raised after both ended)."""
        if self._helper is None:
            raise RuntimeError("HostOverlap.run needs enabled=True (async_mode)")
        handled = self._helper.submit(host_work)
        try:
            stepped = model_step()
        finally:
            done = handled.result()
        return done, stepped

    def close(self) -> None:
        """Stop the helper thread."""
        if self._helper is not None:
            self._helper.shutdown(wait=True)
