"""A warning for a model called from another thread than the one that loaded it.

With OpenMP every thread that runs parallel CPU kernels keeps its own team of worker threads.
Loading a model runs such kernels, so the loading thread has a team; a second thread running the
model brings a second one, and once the two hold more threads than the machine has cores (torch
uses one per core by default) their workers sleep between kernels instead of spinning, and each
kernel waits for them to wake: a 16-row decode step of the ~120M Llama took 10.1 ms on the thread
that loaded it and 16.7-20.1 ms on another (2 cores). The cost is silent, so it is said once.
"""

from __future__ import annotations

import threading
import warnings

import torch


class LoadingThread:
    """The thread that loaded a model, and whether the warning was given."""

    def __init__(self) -> None:
        self.thread = threading.current_thread()
        self.warned = False

    def check(self, device: torch.device) -> None:
        """Warn once when a CPU model runs on another thread while the loading one lives."""
        if self.warned or device.type != "cpu":
            return
        current = threading.current_thread()
        if current is self.thread or not self.thread.is_alive():
            return
        self.warned = True
        warnings.warn(
            f"the model runs on thread {current.name!r} but was loaded on {self.thread.name!r}, "
            "which is still alive: each thread that runs CPU kernels keeps its own OpenMP "
            "workers, and two sets of them can make every step up to 2x slower. Load the model "
            "on the thread that calls it, or call it from the thread that loaded it",
            RuntimeWarning,
            stacklevel=3,
        )
