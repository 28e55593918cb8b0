"""The engine's room in the block cache: blocks lent as a request grows.

A request takes a line (its row in a step, ``seq_ids``) and the blocks its prompt needs when it
is admitted; each decode step asks for one more block when the last one is full, and a request
whose block cannot be had is preempted by the engine (its blocks given back, its tokens
encoded again later). With prefix caching, a prompt's leading full blocks that the cache holds
under the same salt are shared instead of encoded (never the block of its last token, which
the encoding must compute to give the next token's logits).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from nxdplug.plugin_api import CacheSpace, CacheUsage, NxdPlugError
from nxdplug.plugins.block_kv_cache.pool import BlockHash, BlockPool, chained_hashes
from nxdplug.plugins.block_kv_cache.settings import BLOCK_TABLES, BlockSettings

if TYPE_CHECKING:
    from nxdplug.plugin_api import NeuronConfig


def _blocks_for(positions: int, size: int) -> int:
    return -(-positions // size)


class BlockSpace(CacheSpace):
    def __init__(self, neuron_config: NeuronConfig) -> None:
        self.settings = BlockSettings.of(neuron_config)
        self.count = neuron_config.max_batch_size
        self.pool = BlockPool(self.settings.num_blocks)
        self._free_lines = list(range(self.count))
        self._blocks: dict[int, list[int]] = {}
        self._hashes: dict[int, list[BlockHash]] = {}
        self._salts: dict[int, Hashable] = {}
        self._cached: dict[int, int] = {}
        self._queries = 0
        self._hits = 0

    @property
    def free(self) -> int:
        return len(self._free_lines)

    def reserve(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int,
        salt: Hashable = None,
        reuse: bool = True,
    ) -> int | None:
        if not self._free_lines:
            return None
        size, caching = self.settings.block_size, self.settings.prefix_caching and reuse
        hashes = []
        if caching:
            hashes = chained_hashes(prompt_ids, size, salt, (len(prompt_ids) - 1) // size)
        hit = self.pool.cached(hashes)
        needed = _blocks_for(len(prompt_ids), size) - len(hit)
        available = self.pool.free - sum(self.pool.is_free(b) for b in hit)
        if needed > available:
            return None
        line = heapq.heappop(self._free_lines)
        for block in hit:
            self.pool.share(block)
        self._blocks[line] = hit + [self.pool.allocate() for _ in range(needed)]
        self._hashes[line] = hashes[: len(hit)]
        self._salts[line] = salt
        self._cached[line] = len(hit) * size
        if caching:
            self._queries += len(prompt_ids)
            self._hits += len(hit) * size
        return line

    def cached(self, line: int) -> int:
        return self._cached[line]

    def grow(self, line: int, positions: int) -> bool:
        blocks = self._blocks[line]
        needed = _blocks_for(positions, self.settings.block_size) - len(blocks)
        if needed > self.pool.free:
            return False
        blocks += [self.pool.allocate() for _ in range(max(needed, 0))]
        return True

    def commit(self, line: int, token_ids: Sequence[int]) -> None:
        if not self.settings.prefix_caching:
            return
        size, known = self.settings.block_size, self._hashes[line]
        full = min(len(token_ids) // size, len(self._blocks[line]))
        if full <= len(known):
            return
        hashes = chained_hashes(token_ids, size, self._salts[line], full, known)
        new = zip(self._blocks[line][len(known) : full], hashes[len(known) :], strict=True)
        for block, block_hash in new:
            self.pool.register(block, block_hash)
        self._hashes[line] = hashes

    def release(self, line: int) -> None:
        blocks = self._blocks.pop(line, None)
        if blocks is None:
            raise NxdPlugError(f"KV-cache line {line} is not in use")
        for block in blocks:
            self.pool.release(block)
        del self._hashes[line], self._salts[line], self._cached[line]
        heapq.heappush(self._free_lines, line)

    def step_inputs(self, lines: Sequence[int], device: torch.device) -> dict[str, torch.Tensor]:
        width, null = self.settings.blocks_per_line, self.settings.null_block
        tables = [self._blocks[line] + [null] * (width - len(self._blocks[line])) for line in lines]
        return {BLOCK_TABLES: torch.tensor(tables, dtype=torch.long, device=device)}

    def usage(self) -> CacheUsage:
        return CacheUsage(
            used=self.pool.in_use / self.pool.num_blocks,
            prefix_queries=self._queries,
            prefix_hits=self._hits,
            references=self.pool.references(),
        )
