"""The plugin's int8 matmul on the CPU (``int8_matmul.cpp``: decoding in integers, prompts by
dequantized panels), built on first use.

The C++ source is built by :mod:`nxdplug.runtime.cpp_ops` and registers
``torch.ops.nxdplug_quantization.int8_matmul``. Eager models call it; a process that loads a
compiled graph calling it needs it registered first: building the int8 layers does that
(:func:`int8_matmul_op`).

Where it cannot be built (no C++ compiler or ninja, a CPU other than x86), :func:`int8_matmul_op`
returns None after a warning that says why, and the layers dequantize the weight for a GEMM.
``NXDPLUG_INT8_MATMUL_PORTABLE=1`` makes the op take its portable loop on any CPU.

The op reads the weight in the tiled order of :func:`tile_rows`, which is how the int8 layers
hold it: a tile of four rows is then one sequential stream of memory (about twice the
bandwidth of four row streams on this machine).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from nxdplug.plugin_api import build_operator

SOURCE = Path(__file__).with_name("int8_matmul.cpp")
LIBRARY = "nxdplug_quantization"
TILE_ROWS = 4  # the C++ kRowsPerTile
TILE_LANE = 64  # bytes of a row per vpdpbusd (kLane)


@functools.cache
def int8_matmul_op() -> Any | None:
    """``int8_matmul(x [M, K] float32 or bfloat16, weight int8 [N, K] tiled by
    :func:`tile_rows`, scale [N] or [1])`` -> ``[M, N]`` in x's dtype, or None where the
    extension cannot be built."""
    return build_operator(
        LIBRARY,
        SOURCE,
        "int8_matmul",
        _output_like,
        purpose="int8 matmul",
        instead="int8 layers dequantize their weights at each call instead, which is slower",
    )


def _output_like(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def tile_rows(weight: torch.Tensor, lane: int = TILE_LANE) -> torch.Tensor:
    """A [N, K] weight in the order the int8 matmul reads, same shape: the rows in tiles of
    TILE_ROWS, each tile holding its rows' first ``lane`` columns one row after the other, then
    their next ``lane``, ..., then their last ``K % lane``; the last ``N % TILE_ROWS`` rows as
    they are. (The int4 kernels read their weights, scales and zero points in this order
    too.)"""
    rows, features = weight.shape
    tiled_rows = rows // TILE_ROWS * TILE_ROWS
    lanes = features // lane
    count = tiled_rows // TILE_ROWS
    tiles = weight[:tiled_rows].reshape(count, TILE_ROWS, features)
    chunks = tiles[..., : lanes * lane].reshape(count, TILE_ROWS, lanes, lane)
    tails = tiles[..., lanes * lane :]
    tiled = torch.cat(
        (
            chunks.transpose(1, 2).reshape(count, TILE_ROWS * lanes * lane),
            tails.reshape(count, TILE_ROWS * (features - lanes * lane)),
        ),
        dim=1,
    )
    return torch.cat((tiled.reshape(tiled_rows, features), weight[tiled_rows:]))


def untile_rows(tiled: torch.Tensor, lane: int = TILE_LANE) -> torch.Tensor:
    """The [N, K] weight that :func:`tile_rows` put in the tiled order."""
    rows, features = tiled.shape
    tiled_rows = rows // TILE_ROWS * TILE_ROWS
    lanes = features // lane
    count = tiled_rows // TILE_ROWS
    tiles = tiled[:tiled_rows].reshape(count, TILE_ROWS * features)
    chunks = tiles[:, : TILE_ROWS * lanes * lane].reshape(count, lanes, TILE_ROWS, lane)
    tail = features - lanes * lane
    tails = tiles[:, TILE_ROWS * lanes * lane :].reshape(count, TILE_ROWS, tail)
    rows_of_tiles = torch.cat(
        (chunks.transpose(1, 2).reshape(count, TILE_ROWS, lanes * lane), tails), dim=2
    )
    return torch.cat((rows_of_tiles.reshape(tiled_rows, features), tiled[tiled_rows:]))
