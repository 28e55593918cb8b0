"""The room requests take in the KV cache, as the engine asks for it.

A KV-cache strategy plugin says how its cache hands out room (``KVCacheStrategy.cache_space``, a
:class:`CacheSpace` subclass built with the NeuronConfig). The engine reserves room when it
admits a request and gives it back the step the request ends. Each request is addressed by a
line, its row in a step (``seq_ids``); :meth:`CacheSpace.step_inputs` adds what else the
strategy's graphs need to find a line's keys and values (a block cache's block tables).

:class:`CacheLines` is the static layouts' space: a whole line of ``seq_len`` positions per
request, reserved up front, so a running request never runs out. A space that lends room as
requests grow (blocks) says no to :meth:`~CacheSpace.grow` when it has none left; the engine
then preempts a request and encodes it again later. A space may also find a prompt's leading
positions already cached (:meth:`~CacheSpace.cached`): the engine encodes only the rest.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from nxdplug.errors import NxdPlugError

if TYPE_CHECKING:
    from nxdplug.config import NeuronConfig


@attrs.frozen
class CacheUsage:
    """How full the cache is (``used``, 0-1), the prompt tokens looked up in and found in a
    prefix cache, and the references lines hold on shared room (0 when every line is free)."""

    used: float
    prefix_queries: int = 0
    prefix_hits: int = 0
    references: int = 0


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
    def reserve(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int,
        salt: Hashable = None,
        reuse: bool = True,
    ) -> int | None:
        """A line with room for ``prompt_ids`` (and, for a space that does not grow, for
        ``max_tokens`` more tokens), or None when there is no room now. ``salt``: what must
        match for cached positions to be shared (the adapter, a tenant's salt); ``reuse``:
        whether the prompt may start from cached positions at all."""

    def cached(self, line: int) -> int:
        """How many of the prompt's leading positions the line already holds."""
        return 0

    def grow(self, line: int, positions: int) -> bool:
        """Make room in ``line`` for ``positions`` positions; False when there is none."""
        return True

    def commit(self, line: int, token_ids: Sequence[int]) -> None:
        """The line now holds the keys and values of ``token_ids`` (a prefix cache may keep
        them for later prompts); nothing to do for a space that keeps nothing."""
        return None

    @abstractmethod
    def release(self, line: int) -> None:
        """Take back a line and its room."""

    def step_inputs(self, lines: Sequence[int], device: torch.device) -> dict[str, torch.Tensor]:
        """Inputs beside ``seq_ids`` that a call for ``lines`` (one per row) gives the graphs."""
        return {}

    def usage(self) -> CacheUsage:
        return CacheUsage(used=self.in_use / self.count)


class CacheLines(CacheSpace):
    """A whole line per request: the lowest free one, given back when the request ends."""

    def __init__(self, neuron_config: NeuronConfig) -> None:
        self.count = neuron_config.max_batch_size
        self._free = list(range(self.count))

    @property
    def free(self) -> int:
        return len(self._free)

    def reserve(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int,
        salt: Hashable = None,
        reuse: bool = True,
    ) -> int | None:
        return heapq.heappop(self._free) if self._free else None

    def release(self, line: int) -> None:
        if line in self._free or not 0 <= line < self.count:
            raise NxdPlugError(f"KV-cache line {line} is not in use")
        heapq.heappush(self._free, line)
