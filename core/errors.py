"""Exceptions that carry a message meant for a user: what failed and what to do."""

from __future__ import annotations

from collections.abc import Iterable


class NxdPlugError(Exception):
    """Base class for errors the CLI reports as one paragraph, without a traceback."""


class PluginError(NxdPlugError):
    """A plugin could not be loaded, or two plugins claim the same name."""


class UnknownNameError(NxdPlugError, KeyError):
    """A name that no registered plugin provides."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class ConfigError(NxdPlugError):
    """A configuration with one or more problems; all of them are listed at once."""

    def __init__(self, problems: Iterable[str], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} configuration problem(s){where}:\n{lines}")


class CheckpointError(NxdPlugError):
    """A checkpoint that is missing, unreadable, or does not fit the model."""


class NotSupportedError(NxdPlugError, NotImplementedError):
    """A documented feature that this installation does not implement (yet)."""
