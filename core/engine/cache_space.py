"""The room requests take in the KV cache, as the engine asks for it.

A KV-cache strategy plugin says how its cache hands out room (``KVCacheStrategy.cache_space``, a
:class:`CacheSpace` subclass built with the NeuronConfig). The engine reserves room when it
admits a request, for the prompt and every token the request may make, so a running request
never runs out; it gives the room back the step the request ends. Each request is addressed by a
line, the cache row its graphs read and write (``seq_ids``); :meth:`CacheSpace.step_inputs` adds
what else the strategy's graphs need to find a line's keys and values.

:class:`CacheLines` is the static layouts' space: a whole line of ``seq_len`` positions per
request. A block (paged) cache would lend fixed-size blocks instead: ``reserve`` takes the
blocks the prompt and ``max_tokens`` need (None while too few are free, and the request waits),
``step_inputs`` gives each line's block table, ``release`` returns the blocks. Prefix reuse
would let ``reserve`` share the blocks of a prompt's cached prefix; the engine would then encode
only the rest, which needs a context-encoding graph that starts past position 0 (not built yet).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from nxdplug.errors import NxdPlugError


class CacheSpace(ABC):
    """Lines of a KV cache, lent to the engine's requests; ``count`` lines in all."""

    count: int

    @property
    @abstractmethod
    def free(self) -> int:
        """Lines not lent (a request may still find no room in one, see ``reserve``)."""

    @property
    def in_use(self) -> int:
        return self.count - self.free

    @abstractmethod
    def reserve(self, prompt_ids: Sequence[int], max_tokens: int) -> int | None:
        """A line with room for ``prompt_ids`` and ``max_tokens`` more tokens, or None when
        there is no room now."""

    @abstractmethod
    def release(self, line: int) -> None:
        """Take back a line and its room."""

    def step_inputs(self, lines: Sequence[int], device: torch.device) -> dict[str, torch.Tensor]:
        """Inputs beside ``seq_ids`` that a call for ``lines`` (one per row) gives the graphs."""
        return {}


class CacheLines(CacheSpace):
    """A whole line per request: the lowest free one, given back when the request ends."""

    def __init__(self, neuron_config: Any) -> None:
        self.count = neuron_config.max_batch_size
        self._free = list(range(self.count))

    @property
    def free(self) -> int:
        return len(self._free)

    def reserve(self, prompt_ids: Sequence[int], max_tokens: int) -> int | None:
        return heapq.heappop(self._free) if self._free else None

    def release(self, line: int) -> None:
        if line in self._free or not 0 <= line < self.count:
            raise NxdPlugError(f"KV-cache line {line} is not in use")
        heapq.heappush(self._free, line)
