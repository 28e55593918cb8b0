"""The plugin's int8 matmul for decoding on the CPU (``int8_matmul.cpp``), built on first use.

The C++ source is compiled once per machine, Python and torch version by torch's extension
builder (cached under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``) and
registers ``torch.ops.nxdplug_quantization.int8_matmul``. Eager models call it; compiled graphs
keep it as a call by name (AOTInductor's proxy executor), so a process that loads such a graph
needs the op registered first: building the int8 layers does that (:func:`int8_matmul_op`).

Where it cannot be built (no C++ compiler or ninja, a CPU other than x86), :func:`int8_matmul_op`
returns None after a warning that says why, and the layers dequantize the weight for a GEMM.
``NXDPLUG_INT8_MATMUL_PORTABLE=1`` makes the op take its portable loop on any CPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int8_matmul.cpp")
LIBRARY = "nxdplug_quantization"
STALE_LOCK_SECONDS = 600


@functools.cache
def int8_matmul_op() -> Any | None:
    """``int8_matmul(x [M, K] float32 or bfloat16, weight int8 [N, K], scale [N] or [1])`` ->
    ``[M, N]`` in x's dtype, or None where the extension cannot be built."""
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(
            name=LIBRARY,
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(_build_directory(cpp_extension.get_default_build_root())),
            is_python_module=False,
        )
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning(
            "nxdplug's int8 matmul (%s) could not be built: %s; int8 layers dequantize their "
            "weights at each call instead, which is slower",
            SOURCE.name,
            _first_error_line(str(error)),
        )
        return None
    torch.library.register_fake(f"{LIBRARY}::int8_matmul")(_output_like)
    return getattr(torch.ops, LIBRARY).int8_matmul


def _build_directory(root: str) -> Path:
    """The build folder, one per Python and torch version (the library links torch's). A lock
    left there by a build that was killed would make every later process wait for it forever
    (torch's builder waits while the file exists); a build takes seconds, so a lock older than
    STALE_LOCK_SECONDS is removed."""
    version = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    folder = Path(root) / f"{LIBRARY}-{version.replace('+', '-')}"
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    with contextlib.suppress(FileNotFoundError):
        if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            log.warning("removing %s, left by an int8 matmul build that did not finish", lock)
            lock.unlink()
    return folder


def _output_like(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def _first_error_line(message: str) -> str:
    """The compiler's first ``error:`` line, else the message's first line (shortened)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or ["no message"])[0][:300]
