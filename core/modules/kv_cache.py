"""The KV-cache manager interface; the layouts themselves are plugins (``kv_cache_strategies``).

A cache lives in the model as buffers updated in place, so a traced graph carries it as state.
Each step, attention hands the manager the new keys and values with their positions and batch
rows (``seq_ids``) and gets back the keys and values of the first ``length`` positions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import attrs
import torch
from torch import nn

if TYPE_CHECKING:
    from nxdplug.config import NeuronConfig


@attrs.frozen
class CacheLayout:
    """The shape of the cache a model needs."""

    num_layers: int
    max_batch_size: int
    num_kv_heads: int
    max_length: int
    head_dim: int
    dtype: torch.dtype
    # The NeuronConfig, for a layout's own settings (a block cache's block count and size).
    neuron_config: NeuronConfig | None = attrs.field(default=None, eq=False, repr=False)


class KVCacheManager(nn.Module, ABC):
    def __init__(self, layout: CacheLayout) -> None:
        super().__init__()
        self.layout = layout

    @abstractmethod
    def update_and_read(
        self,
        layer: int,
        key: torch.Tensor,
        value: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor,
        length: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key``/``value`` ([batch, kv_heads, seq, head_dim]) at ``position_ids``
        ([batch, seq]) of rows ``seq_ids`` ([batch]); return the rows' first ``length``
        positions as [batch, kv_heads, length, head_dim] in the keys' dtype."""

    def store_and_attend(
        self,
        layer: int,
        q: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor,
    ) -> torch.Tensor | None:
        """Store ``key``/``value`` as :meth:`update_and_read` does, then return softmax(q K^T /
        sqrt(head_dim), ``mask``) V over the rows' cached positions, reading them where they
        are: [batch, heads, queries, head_dim] in q's dtype (``mask``: boolean [batch, 1,
        queries, keys]). Or None, having stored nothing, where this manager has no such
        attention for these inputs (the default): the caller then reads the positions with
        :meth:`update_and_read` and attends over them itself."""
        return None

    @classmethod
    def graph_variant(cls) -> str:
        """What, beyond the config, decides the graphs this layout's attention traces (a kernel
        in use or not here); it is part of a compiled folder's hash, so that a folder traced
        one way is not taken for the other. Empty (the default) when nothing does."""
        return ""

    @abstractmethod
    def reset(self) -> None:
        """Forget every stored position."""

    def position_buffers(self) -> list[torch.Tensor]:
        """The buffers indexed [batch row, head, position, ...] (keys and values, not scales)."""
        layout = self.layout
        rows = (layout.max_batch_size, layout.num_kv_heads, layout.max_length)
        return [b for b in self.buffers() if b.dim() >= 3 and tuple(b.shape[:3]) == rows]

    def move_positions(
        self, seq_ids: torch.Tensor, source: torch.Tensor, destination: torch.Tensor
    ) -> None:
        """Copy what rows ``seq_ids`` ([batch]) hold at positions ``source`` ([batch, n]) to
        ``destination`` ([batch, n]) in every layer: speculation keeps the accepted branch of a
        tree this way. All sources are read before anything is written."""
        rows = seq_ids[:, None]
        for buffer in self.position_buffers():
            moved = buffer[rows, :, source]
            buffer[rows, :, destination] = moved


def kv_cache_managers(model: nn.Module) -> list[KVCacheManager]:
    """Every KV-cache manager in ``model`` (the model's own, and a fused draft's)."""
    return [module for module in model.modules() if isinstance(module, KVCacheManager)]


def write_positions(
    cache: torch.Tensor, seq_ids: torch.Tensor, position_ids: torch.Tensor, new: torch.Tensor
) -> None:
    """BHSD layout: ``cache[row, :, position, :] = new[b, :, t, :]`` for every (b, t), rows
    ``seq_ids[b]`` and positions ``position_ids[b, t]``."""
    cache[seq_ids[:, None], :, position_ids] = new.transpose(1, 2).to(cache.dtype)


def read_prefix(cache: torch.Tensor, seq_ids: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of rows ``seq_ids``: [batch, heads, length, dim]."""
    return cache[seq_ids, :, :length]


def first_row_of_each_line(seq_ids: torch.Tensor) -> torch.Tensor:
    """For each row of ``seq_ids`` ([batch]), the first row writing to the same cache line:
    the row itself, unless it repeats an earlier row's line (a padding row)."""
    same_line = seq_ids[:, None] == seq_ids[None, :]
    return same_line.int().argmax(dim=1)  # argmax gives the first of equal maxima


@attrs.frozen
class CacheSlot:
    """Where one layer's keys and values go in this step.

    ``writer_rows`` ([batch], see :func:`first_row_of_each_line`), when given, makes each row
    write the keys and values of the first row sharing its cache line: padding rows that repeat
    a running row's line (continuous batching) then write exactly that row's values, not
    values a batched product may have rounded differently in another row, so the order of the
    duplicate writes does not matter.
    """

    manager: KVCacheManager
    layer: int
    position_ids: torch.Tensor
    seq_ids: torch.Tensor
    length: int
    writer_rows: torch.Tensor | None = None

    def store_and_fetch(
        self, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key, value = self._written(key, value)
        return self.manager.update_and_read(
            self.layer, key, value, self.position_ids, self.seq_ids, self.length
        )

    def store_and_attend(
        self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor | None:
        """Store the step's keys and values and return the plain softmax attention of ``q``
        over the cache, computed by the manager where they lie; None, having stored nothing,
        where the manager has no such attention (see KVCacheManager.store_and_attend)."""
        key, value = self._written(key, value)
        return self.manager.store_and_attend(
            self.layer, q, key, value, mask, self.position_ids, self.seq_ids
        )

    def _written(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.writer_rows is None:
            return key, value
        return key[self.writer_rows], value[self.writer_rows]
