"""Sequence parallelism (``sequence_parallel_enabled``), Megatron's pattern over the
tensor-parallel ranks, for context encoding.

Between the attention and MLP blocks each rank keeps only its slice of the sequence: the
residual stream, the residual adds and the norms work on ``seq / tp`` tokens. Before a block's
column-parallel projections the slices are gathered; after its row-parallel projection each
rank keeps its slice of the sum again. (The sum is an all-reduce followed by a slice rather than
a reduce-scatter: all-reduce is the collective AOTInductor's CPU runtime provides. The traffic is
the same; the full block output exists for a moment before it is cut.)

The model decides per step whether the sequence is split, and says so through
:func:`split_sequence`; decoder layers ask :func:`current_shards`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import attrs
import torch

from nxdplug.errors import ConfigError
from nxdplug.modules.parallel_linear import TP, all_gather


@attrs.frozen
class SequenceShards:
    """The sequence cut into ``world`` equal slices along dim 1; this rank holds ``rank``."""

    world: int
    rank: int
    group: str = TP

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full sequence ``x`` [batch, seq, ...]."""
        length = x.shape[1]
        if length % self.world:
            raise ConfigError(
                [
                    f"sequence parallelism needs a sequence of {length} tokens to split over "
                    f"{self.world} ranks; make the context-encoding buckets divisible by "
                    "tp_degree"
                ]
            )
        size = length // self.world
        return x.narrow(1, self.rank * size, size)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's slice side by side along dim 1, in rank order."""
        return all_gather(x, 1, self.rank, self.world, self.group)


_SHARDS: ContextVar[SequenceShards | None] = ContextVar("nxdplug_sequence_shards", default=None)


@contextmanager
def split_sequence(shards: SequenceShards | None) -> Iterator[None]:
    """While the block runs, :func:`current_shards` returns ``shards`` (None: not split)."""
    token = _SHARDS.set(shards)
    try:
        yield
    finally:
        _SHARDS.reset(token)


def current_shards() -> SequenceShards | None:
    """How the running step's sequence is split over the ranks; None when it is whole."""
    return _SHARDS.get()
