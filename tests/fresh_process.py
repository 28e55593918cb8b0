"""Running a snippet in a fresh Python process (an environment variable read once per process,
a CPU path forced) and loading the tensors it saved; which CPU paths this machine takes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch


def run_and_load(script: str, folder: Path, *arguments: str, **environment: str) -> Any:
    """Run ``script`` (it may import the test modules; it saves its result with
    ``torch.save(..., sys.argv[1])``; ``arguments`` follow) with ``environment`` added, and
    return what it saved."""
    env = dict(os.environ, **environment)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")])
    )
    saved = folder / "saved.pt"
    result = subprocess.run(
        [sys.executable, "-c", script, str(saved), *arguments],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return torch.load(saved)


def cpu_has(*flags: str) -> bool:
    """Whether /proc/cpuinfo lists every one of ``flags`` (False where it cannot be read)."""
    try:
        listed = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(flag in listed for flag in flags)


# The x86 flags the bf16 panel GEMM (plugins/inductor_backend/bf16_linear.cpp) runs on.
needs_avx512_bf16 = pytest.mark.skipif(
    not cpu_has("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
    reason="the panel kernel runs on x86 CPUs with AVX512-BF16",
)
