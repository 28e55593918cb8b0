"""Folders and files that appear complete or not at all.

Everything is written under a temporary name beside its destination and renamed into place, so
an interrupted run never leaves something half-written that looks finished. Processes that may
write the same destination at once take :func:`writer_lock` first.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_folder(destination: Path) -> Iterator[Path]:
    """A temporary folder beside ``destination`` that replaces it only if the block succeeds."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = destination.parent / f".{destination.name}.{uuid.uuid4().hex[:8]}.partial"
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_folder(staging, destination)


@contextmanager
def writer_lock(destination: Path) -> Iterator[None]:
    """Hold the lock of ``destination`` (a file beside it) while the block runs: another process
    taking it waits until this one is done, then sees what it wrote. Staged folders of
    ``destination`` left by a process killed while it held the lock are removed once taken."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    with open(destination.parent / f".{destination.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            for stale in destination.parent.glob(f".{destination.name}.*.partial"):
                shutil.rmtree(stale, ignore_errors=True)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def replace_folder(source: Path, destination: Path) -> None:
    """Rename ``source`` to ``destination``; an existing destination is swapped out first and
    put back if the swap fails."""
    if not destination.exists():
        os.replace(source, destination)
        return
    retired = destination.parent / f".{destination.name}.{uuid.uuid4().hex[:8]}.old"
    os.replace(destination, retired)
    try:
        os.replace(source, destination)
    except BaseException:
        os.replace(retired, destination)
        raise
    shutil.rmtree(retired, ignore_errors=True)


def save_text_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
