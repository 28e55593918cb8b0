"""The ``block_tables`` step input: each row's blocks, [batch, blocks_per_line].

The serving engine's cache space gives the tables of the blocks it lent (the keyword
``block_tables``); without one (``generate()``, ``forward()``), every entry is -1: each row uses
its own line of blocks, which needs a pool of ``max_batch_size x blocks_per_line`` blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from nxdplug.plugin_api import NxdPlugError
from nxdplug.plugins.block_kv_cache.settings import BLOCK_TABLES, BlockSettings

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig


class BlockTables:
    def __init__(self, config: InferenceConfig) -> None:
        self.neuron_config = config.neuron_config
        self.settings = BlockSettings.of(self.neuron_config)

    def example(self, batch_size: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Tables of the null block only: valid whatever the pool's size (a compiled graph's
        warm-up runs them)."""
        settings = self.settings
        shape = (batch_size, settings.blocks_per_line)
        return {BLOCK_TABLES: torch.full(shape, settings.null_block, device=device)}

    def build(
        self, batch_size: int, keywords: Mapping[str, Any], device: torch.device
    ) -> dict[str, torch.Tensor]:
        tables = keywords.get(BLOCK_TABLES)
        if tables is None:
            return {BLOCK_TABLES: self._own_lines(batch_size, device)}
        tables = torch.as_tensor(tables, dtype=torch.long, device=device)
        expected = (batch_size, self.settings.blocks_per_line)
        if tuple(tables.shape) != expected:
            raise NxdPlugError(
                f"block_tables has shape {tuple(tables.shape)}; expected {expected} (a row per "
                "sequence, seq_len / pa_block_size blocks each)"
            )
        return {BLOCK_TABLES: tables}

    def reset(self) -> None:
        """Nothing to reset: tables are given each step."""

    def _own_lines(self, batch_size: int, device: torch.device) -> torch.Tensor:
        settings = self.settings
        needed = self.neuron_config.max_batch_size * settings.blocks_per_line
        if settings.num_blocks < needed:
            raise NxdPlugError(
                f"without block tables each sequence uses its own line of blocks, which takes "
                f"max_batch_size x seq_len / pa_block_size = {needed} blocks, but "
                f"pa_num_blocks={settings.num_blocks}; pass block_tables, serve through the "
                "engine (it lends blocks), or raise pa_num_blocks"
            )
        return torch.full(
            (batch_size, settings.blocks_per_line), -1, dtype=torch.long, device=device
        )
