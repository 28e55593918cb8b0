"""Building plugins' C++ operators (``nxdplug.runtime.cpp_ops``)."""

from __future__ import annotations

import os
import time

from nxdplug.runtime.cpp_ops import STALE_LOCK_SECONDS, build_directory, first_error_line


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path) -> None:
    """torch's builder waits as long as its lock file exists; one from a build that never
    finished would hang every later process."""
    fresh = build_directory("lib", str(tmp_path / "fresh"))
    (fresh / "lock").touch()
    assert build_directory("lib", str(tmp_path / "fresh")) == fresh and (fresh / "lock").exists()

    stale = build_directory("lib", str(tmp_path / "stale"))
    (stale / "lock").touch()
    old = time.time() - STALE_LOCK_SECONDS - 60
    os.utime(stale / "lock", (old, old))
    assert build_directory("lib", str(tmp_path / "stale")) == stale
    assert not (stale / "lock").exists()


def test_the_build_folder_is_one_per_library_python_and_torch(tmp_path) -> None:
    first = build_directory("first", str(tmp_path))
    second = build_directory("second", str(tmp_path))
    assert first != second and first.name.startswith("first-py") and "torch" in first.name


def test_the_compiler_error_is_the_line_reported() -> None:
    message = "ninja: build stopped\nfoo.cpp:3:1: error: expected ';'\nmore"
    assert first_error_line(message) == "foo.cpp:3:1: error: expected ';'"
    assert first_error_line("Command failed\nsecond") == "Command failed"
    assert first_error_line("") == "no message"
