"""Named process groups over the launched ranks: the parallel layout.

Every layer that talks to other ranks names the group it talks over. The core's group is
``tp``, all the launched ranks; a plugin adds its own through a ``parallel_groups`` record
(experts split over an ``ep`` group, a phase with a sharding of its own), as a partition of the
ranks into equal blocks, each block one group. Each process builds the groups once, in the same
order on every rank (torch.distributed requires every rank to take part in making each group),
and looks its own block up by name.

Without an initialized process group there is one rank, and every group is that rank alone;
so it is inside :func:`this_rank_alone`, where a model for one rank is built among several
(a draft the first rank holds whole).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs
import torch.distributed as dist

from nxdplug.errors import ConfigError

TP = "tp"


@attrs.define
class ParallelLayout:
    """This process's rank, and its block of each named group."""

    world_size: int
    rank: int
    world: Any = None  # the default group these groups were made under
    partitions: dict[str, tuple[tuple[int, ...], ...]] = attrs.field(factory=dict)
    handles: dict[str, Any] = attrs.field(factory=dict)

    def add(self, name: str, partition: Iterable[Iterable[int]]) -> None:
        """Make the group ``name``: ``partition`` splits the ranks into equal blocks. Adding
        the same partition again does nothing; another one under a taken name is refused."""
        blocks = tuple(tuple(block) for block in partition)
        self._check(name, blocks)
        if name in self.partitions:
            if self.partitions[name] != blocks:
                raise ConfigError(
                    [
                        f"process group {name!r} is laid out as {self.partitions[name]}; a plugin "
                        f"asked for {blocks} under the same name"
                    ]
                )
            return
        self.partitions[name] = blocks
        mine = next(block for block in blocks if self.rank in block)
        if len(mine) == self.world_size:
            self.handles[name] = None  # the default group
            return
        for block in blocks:  # every rank makes every block's group, in the same order
            handle = dist.new_group(list(block))
            if block == mine:
                self.handles[name] = handle

    def _check(self, name: str, blocks: tuple[tuple[int, ...], ...]) -> None:
        ranks = sorted(rank for block in blocks for rank in block)
        sizes = {len(block) for block in blocks}
        if ranks != list(range(self.world_size)) or len(sizes) != 1:
            raise ConfigError(
                [
                    f"process group {name!r} must split the {self.world_size} rank(s) into blocks "
                    f"of one size, each rank in one block; got {[list(b) for b in blocks]}"
                ]
            )

    def block(self, name: str) -> tuple[int, ...]:
        """The ranks of this process's group ``name``."""
        try:
            blocks = self.partitions[name]
        except KeyError:
            known = ", ".join(self.partitions) or "none"
            raise ConfigError(
                [
                    f"no process group {name!r} is laid out (the groups: {known}); the plugin "
                    "that declares it is not enabled"
                ]
            ) from None
        return next(block for block in blocks if self.rank in block)

    def size(self, name: str) -> int:
        return len(self.block(name))

    def rank_in(self, name: str) -> int:
        return self.block(name).index(self.rank)

    def process_group(self, name: str) -> Any:
        """The torch.distributed group of ``name`` for this rank (None: the default group)."""
        self.block(name)
        return self.handles[name]


_layout: ParallelLayout | None = None
_alone: ParallelLayout | None = None


def current_layout() -> ParallelLayout:
    """The layout of this process: made with the ``tp`` group when first asked for, and made
    anew when the default process group changes (one rank when there is none, or inside
    :func:`this_rank_alone`)."""
    global _layout
    if _alone is not None:
        return _alone
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.group.WORLD if initialized else None
    if _layout is None or _layout.world is not world:
        size = dist.get_world_size() if initialized else 1
        rank = dist.get_rank() if initialized else 0
        _layout = ParallelLayout(size, rank, world)
        _layout.add(TP, [range(size)])
    return _layout


@contextlib.contextmanager
def this_rank_alone() -> Iterator[None]:
    """Inside, this process is a launch of one rank: every group is this rank alone. A model
    built (and loaded) here is whole, not sharded, and its layers never talk to the other
    ranks; the first rank builds a draft it runs by itself this way."""
    global _alone
    outer = _alone
    _alone = ParallelLayout(1, 0)
    _alone.add(TP, [range(1)])
    try:
        yield
    finally:
        _alone = outer


def add_group(name: str, partition: Sequence[Sequence[int]]) -> None:
    """Lay out the group ``name`` in this process (see :meth:`ParallelLayout.add`)."""
    current_layout().add(name, partition)


def group_size(name: str = TP) -> int:
    """Ranks in this process's group ``name``."""
    return current_layout().size(name)


def group_rank(name: str = TP) -> int:
    """This process's rank within its group ``name``."""
    return current_layout().rank_in(name)
