""" "Did you mean ...?" hints for misspelt names."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``choices``, or ``""`` when none is close."""
    close = difflib.get_close_matches(name, sorted(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
