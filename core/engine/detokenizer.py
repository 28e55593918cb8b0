"""A request's text as its tokens arrive: decoded incrementally, cut at stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

INCOMPLETE = "\ufffd"  # what a tokenizer decodes a partial UTF-8 sequence to


class IncrementalText:
    """Decodes a request's output tokens step by step.

    ``update(output_ids)`` returns the text that is final since the last call, and whether a
    stop string ended the request. Text that could still be the start of a stop string is held
    back until later tokens settle it; ``finish()`` releases it once the request ends.

    Each step decodes only the tokens since the last decoded one, with the few before them as
    context (a tokenizer may render a token differently at the start of a text, e.g. without
    its leading space): the text they add is the decoded window minus its decoded context. A
    window ending in an incomplete character adds nothing until later tokens complete it. The
    cost per step stays constant, not proportional to the output so far.
    """

    def __init__(
        self, tokenizer: Any, stop: Sequence[str] = (), skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.released = 0
        self.output_ids: list[int] = []
        self.context_start = 0  # first token of the context decoded before new tokens
        self.decoded = 0  # tokens whose text is in self.text
        self.stopped = False

    def update(self, output_ids: Sequence[int]) -> tuple[str, bool]:
        self.output_ids = list(output_ids)
        self.text += self._new_text(complete=False)
        cut = self._first_stop()
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return self._release(len(self.text)), True
        return self._release(len(self.text) - self.hold), False

    def finish(self) -> str:
        """The rest of the text (an incomplete character at the end included)."""
        if not self.stopped:
            self.text += self._new_text(complete=True)
        return self._release(len(self.text))

    def _new_text(self, complete: bool) -> str:
        ids = self.output_ids
        context = self._decode(ids[self.context_start : self.decoded])
        window = self._decode(ids[self.context_start :])
        if len(window) <= len(context) or (window.endswith(INCOMPLETE) and not complete):
            return ""
        self.context_start, self.decoded = self.decoded, len(ids)
        return window[len(context) :]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

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
