"""A server started as a subprocess for a benchmark: ready when ``GET /health`` answers 200,
stopped with SIGTERM. Its output goes to a temporary file, whose tail explains a failed start."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from typing import IO

from nxdplug.plugin_api import NxdPlugError

STOP_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.5
TAIL_LINES = 30


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS's pick; free again once this returns)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(
    command: Sequence[str],
    health_url: str,
    start_timeout_s: float,
    env: Mapping[str, str] | None = None,
) -> Iterator[subprocess.Popen]:
    """Start ``command``, wait until ``health_url`` answers 200, yield, then stop it.

    A server that exits or is not ready in ``start_timeout_s`` raises an error with the tail
    of its output.
    """
    with tempfile.TemporaryFile(mode="w+b") as log:
        process = subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        try:
            _wait_until_healthy(process, health_url, start_timeout_s, log)
            yield process
        finally:
            _stop(process)


def _wait_until_healthy(
    process: subprocess.Popen, url: str, timeout_s: float, log: IO[bytes]
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise NxdPlugError(
                f"the server exited with code {process.returncode} before answering {url}:\n"
                + _tail(log)
            )
        try:
            with urllib.request.urlopen(url, timeout=POLL_INTERVAL_S * 4) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(POLL_INTERVAL_S)
    raise NxdPlugError(
        f"the server did not answer {url} within {timeout_s:g} s "
        f"(command: {' '.join(process.args)}):\n" + _tail(log)
    )


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _tail(log: IO[bytes]) -> str:
    log.flush()
    log.seek(0)
    lines = log.read().decode("utf-8", errors="replace").splitlines()
    return "\n".join(lines[-TAIL_LINES:]) or "(no output)"
