"""A request's text as its tokens arrive: decoded incrementally, cut at stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

INCOMPLETE = "\ufffd"  # what a tokenizer decodes a partial UTF-8 sequence to


class IncrementalText:
    """Decodes a request's output tokens step by step.

    ``update(output_ids)`` returns the text that is final since the last call, and whether a
    stop string ended the request. Text that could still be the start of a stop string, or that
    ends in an incomplete character, is held back until later tokens settle it; ``finish()``
    releases it once the request ends.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.released = 0

    def update(self, output_ids: Sequence[int]) -> tuple[str, bool]:
        self.text = self.tokenizer.decode(list(output_ids), skip_special_tokens=True)
        cut = self._first_stop()
        if cut is not None:
            self.text = self.text[:cut]
            return self.finish(), True
        settled = len(self.text) - self.hold
        while settled > self.released and self.text[settled - 1] == INCOMPLETE:
            settled -= 1
        return self._release(settled), False

    def finish(self) -> str:
        return self._release(len(self.text))

    def _first_stop(self) -> int | None:
        # A stop string ending in new text starts at most `hold` characters before it.
        start = max(self.released - self.hold, 0)
        found = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        return min(found, default=None)

    def _release(self, end: int) -> str:
        if end <= self.released:
            return ""
        piece, self.released = self.text[self.released : end], end
        return piece
