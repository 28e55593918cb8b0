"""Sequence parallelism (``sequence_parallel_enabled``), Megatron's pattern over the
tensor-parallel ranks, for context encoding.

Between the attention and MLP blocks each rank keeps only its slice of the sequence: the
residual stream, the residual adds and the norms work on ``seq / tp`` tokens. Before a block's
column-parallel projections the slices are gathered; after its row-parallel projection each
rank keeps its slice of the sum again. (The sum is an all-reduce followed by a slice rather than
a reduce-scatter: all-reduce is the collective AOTInductor's CPU runtime provides. The traffic is
the same; the full block output exists for a moment before it is cut.)

The model decides per step whether the sequence is split, and says so through
:func:`split_sequence`; decoder layers call :func:`gather_sequence` before a block and
:func:`scatter_sequence` after it, which pass tensors through unchanged when it is whole.
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
    """While the block runs, :func:`gather_sequence` and :func:`scatter_sequence` split the
    sequence as ``shards`` says (None: not split)."""
    token = _SHARDS.set(shards)
    try:
        yield
    finally:
        _SHARDS.reset(token)


def gather_sequence(x: torch.Tensor) -> torch.Tensor:
    """The whole sequence from this rank's slice ``x`` [batch, seq / tp, ...]; ``x`` itself
    when the running step's sequence is not split."""
    shards = _SHARDS.get()
    return x if shards is None else shards.gather(x)


def scatter_sequence(x: torch.Tensor, *, copy: bool = False) -> torch.Tensor:
    """This rank's slice of the whole sequence ``x`` [batch, seq, ...]; ``x`` itself when the
    running step's sequence is not split. ``copy`` makes the slice a tensor of its own, so
    that it does not keep the whole ``x`` alive."""
    shards = _SHARDS.get()
    if shards is None:
        return x
    return shards.scatter(x).clone() if copy else shards.scatter(x)
