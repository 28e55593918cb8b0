"""The plugin's int8 matmul for decoding on the CPU (``int8_matmul.cpp``), built on first use.

The C++ source is built by :mod:`nxdplug.runtime.cpp_ops` and registers
``torch.ops.nxdplug_quantization.int8_matmul``. Eager models call it; a process that loads a
compiled graph calling it needs it registered first: building the int8 layers does that
(:func:`int8_matmul_op`).

Where it cannot be built (no C++ compiler or ninja, a CPU other than x86), :func:`int8_matmul_op`
returns None after a warning that says why, and the layers dequantize the weight for a GEMM.
``NXDPLUG_INT8_MATMUL_PORTABLE=1`` makes the op take its portable loop on any CPU.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from nxdplug.runtime.cpp_ops import build_operator

SOURCE = Path(__file__).with_name("int8_matmul.cpp")
LIBRARY = "nxdplug_quantization"


@functools.cache
def int8_matmul_op() -> Any | None:
    """``int8_matmul(x [M, K] float32 or bfloat16, weight int8 [N, K], scale [N] or [1])`` ->
    ``[M, N]`` in x's dtype, or None where the extension cannot be built."""
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
