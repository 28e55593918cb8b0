"""Which KV-cache lines are free.

The static cache gives each running request one line (a batch row of the cache); a request
takes the lowest free line and gives it back when it ends. A block (paged) cache would hand out
blocks instead: this is the one place the engine asks for room.
"""

from __future__ import annotations

import heapq

from nxdplug.errors import NxdPlugError


class CacheLines:
    def __init__(self, count: int) -> None:
        self.count = count
        self._free = list(range(count))

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.count - len(self._free)

    def take(self) -> int:
        if not self._free:
            raise NxdPlugError("no free KV-cache line")
        return heapq.heappop(self._free)

    def release(self, line: int) -> None:
        if line in self._free or not 0 <= line < self.count:
            raise NxdPlugError(f"KV-cache line {line} is not in use")
        heapq.heappush(self._free, line)
