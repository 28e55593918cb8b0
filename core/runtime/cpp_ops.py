"""Plugins' C++ operators, built on first use by torch's extension builder.

A plugin ships a ``.cpp`` file that registers its operators with ``TORCH_LIBRARY``;
:func:`build_operator_library` compiles it once per machine, Python and torch version (cached
under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``) and loads it into the
process. Compiled graphs keep such operators as calls by name (AOTInductor's proxy executor), so a
process must register them before it loads a graph that calls them.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# Headers the operators may include (``#include <nxdplug_bf16_panels.h>``): this folder's.
INCLUDE_DIRECTORY = Path(__file__).parent
# A build takes seconds; a lock older than this was left by a build that was killed.
STALE_LOCK_SECONDS = 600


def build_operator(
    library: str,
    source: Path,
    operator: str,
    fake: Callable[..., torch.Tensor],
    *,
    purpose: str,
    instead: str,
) -> Any | None:
    """``torch.ops.<library>.<operator>`` from ``source``, built and loaded, with ``fake`` (its
    output for given inputs, without computing it) registered for tracing; None where it cannot
    be built (see :func:`build_operator_library`). Call it once per process."""
    operators = build_operators(library, source, {operator: fake}, purpose=purpose, instead=instead)
    return None if operators is None else getattr(operators, operator)


def build_operators(
    library: str,
    source: Path,
    fakes: Mapping[str, Callable[..., torch.Tensor]],
    *,
    purpose: str,
    instead: str,
) -> Any | None:
    """``torch.ops.<library>`` from ``source``, built and loaded, with each operator's fake
    (``fakes``, by operator name) registered for tracing; None where it cannot be built. Call it
    once per process."""
    if not build_operator_library(library, source, purpose=purpose, instead=instead):
        return None
    for operator, fake in fakes.items():
        torch.library.register_fake(f"{library}::{operator}")(fake)
    return getattr(torch.ops, library)


def build_operator_library(library: str, source: Path, *, purpose: str, instead: str) -> bool:
    """Build and load ``source`` (its ``TORCH_LIBRARY(library, ...)`` operators); False, after
    a warning naming ``purpose``, the compiler's first error and what happens ``instead``, where
    it cannot be built (no C++ compiler or ninja, a compiler error)."""
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(
            name=library,
            sources=[str(source)],
            extra_cflags=["-O3", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(INCLUDE_DIRECTORY)],
            build_directory=str(build_directory(library, cpp_extension.get_default_build_root())),
            is_python_module=False,
        )
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning(
            "nxdplug's %s (%s) could not be built: %s; %s",
            purpose,
            source.name,
            first_error_line(str(error)),
            instead,
        )
        return False
    return True


def build_directory(library: str, root: str) -> Path:
    """The build folder, one per Python and torch version (the library links torch's). A lock
    left there by a build that was killed would make every later process wait for it forever
    (torch's builder waits while the file exists), so a lock older than STALE_LOCK_SECONDS is
    removed."""
    version = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    folder = Path(root) / f"{library}-{version.replace('+', '-')}"
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    with contextlib.suppress(FileNotFoundError):
        if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            log.warning("removing %s, left by a build of %s that did not finish", lock, library)
            lock.unlink()
    return folder


def first_error_line(message: str) -> str:
    """The compiler's first ``error:`` line, else the message's first line (shortened)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or ["no message"])[0][:300]
