"""The blocks of the cache as the engine lends them, and the prefix cache over them.

Every block has a reference count: the lines whose tables hold it. A block no line holds is
free, queued from least to most recently freed; allocating takes the front of the queue. With
prefix caching, a full block is registered under the hash of its tokens chained to its parent
block's hash and the request's salt (its adapter, vLLM's ``cache_salt``): a later prompt with
the same tokens under the same salt finds the block again and shares it; a free block keeps its
registration until the queue hands it out again (least recently used eviction).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from nxdplug.plugin_api import NxdPlugError

BlockHash = bytes


def chained_hashes(
    token_ids: Sequence[int],
    block_size: int,
    salt: Hashable,
    count: int,
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """The hashes of the first ``count`` full blocks of ``token_ids``: ``known`` (those of the
    first blocks, already computed), then the rest, each chained to the one before."""
    hashes = list(known[:count])
    parent = hashes[-1] if hashes else repr(salt).encode()
    for index in range(len(hashes), count):
        tokens = token_ids[index * block_size : (index + 1) * block_size]
        parent = hashlib.sha256(parent + repr(tuple(tokens)).encode()).digest()
        hashes.append(parent)
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._references = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._by_hash: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.num_blocks - len(self._free)

    def cached(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks registered under the longest prefix of ``hashes``."""
        blocks = []
        for block_hash in hashes:
            block = self._by_hash.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def is_free(self, block: int) -> bool:
        return self._references[block] == 0

    def share(self, block: int) -> None:
        """One more line holds ``block`` (a cached block found again)."""
        if self._references[block] == 0:
            del self._free[block]
        self._references[block] += 1

    def allocate(self) -> int:
        """A free block for one line, its old registration dropped (evicted)."""
        if not self._free:
            raise NxdPlugError("no free KV-cache block (the engine checks room first)")
        block, _ = self._free.popitem(last=False)
        old = self._hash_of.pop(block, None)
        if old is not None:
            del self._by_hash[old]
        self._references[block] = 1
        return block

    def release(self, block: int) -> None:
        """A line gives ``block`` back; once no line holds it, it joins the free queue's end."""
        if self._references[block] <= 0:
            raise NxdPlugError(f"KV-cache block {block} is not in use")
        self._references[block] -= 1
        if self._references[block] == 0:
            self._free[block] = None

    def register(self, block: int, block_hash: BlockHash) -> None:
        """``block`` holds the full block that ``block_hash`` names (kept if another block
        already holds the same tokens)."""
        if block_hash in self._by_hash or block in self._hash_of:
            return
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash

    def references(self) -> int:
        """The references lines hold, in all (0 once every line gave its blocks back)."""
        return sum(self._references)
