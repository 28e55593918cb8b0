"""``<think>...</think>``: the reasoning Qwen3 and DeepSeek-R1 write before their answer.

The reply reasons when it opens with ``<think>`` or when its prompt ends with it (Qwen3's
thinking templates and DeepSeek-R1's open it there). Reasoning is told without the whitespace
around it, and the answer without the whitespace it begins with, as transformers' response
template for Qwen3 reads them.
"""

from __future__ import annotations

import enum

from nxdplug.plugins.serve.reasoning import Split
from nxdplug.plugins.serve.tool_calls import held_back

OPEN = "<think>"
CLOSE = "</think>"


class State(enum.Enum):
    BEGINNING = enum.auto()  # nothing told yet: the reply may open <think>
    THINKING = enum.auto()
    CLOSED = enum.auto()  # after </think>, before the answer's first non-space
    ANSWERING = enum.auto()


class ThinkTags:
    """Qwen3's: a reply that does not open ``<think>`` (nor its prompt) is all answer."""

    reasons_first = False

    def __init__(self, prompt: str) -> None:
        opened = prompt.rstrip().endswith(OPEN)
        self._state = State.THINKING if opened else State.BEGINNING
        self._pending = ""
        self._reasoning_begun = False

    def feed(self, text: str) -> Split:
        self._pending += text
        reasoning: list[str] = []
        answer: list[str] = []
        while self._pending and self._step(reasoning, answer):
            pass
        return Split("".join(reasoning), "".join(answer))

    def finish(self) -> Split:
        pending, self._pending = self._pending, ""
        if self._state is State.THINKING or (self._state is State.BEGINNING and self.reasons_first):
            return Split(reasoning=pending.strip())
        return Split(answer=pending)

    def _step(self, reasoning: list[str], answer: list[str]) -> bool:
        """Tell what the pending text tells in the current state; False when the rest must
        wait for more text."""
        if self._state is State.BEGINNING:
            begun = self._pending.lstrip()
            if begun.startswith(OPEN):
                self._pending = begun[len(OPEN) :]
                self._state = State.THINKING
                return True
            if OPEN.startswith(begun):  # nothing yet, or the start of <think>
                return False
            self._pending = begun
            self._state = State.THINKING if self.reasons_first else State.ANSWERING
            return True
        if self._state is State.THINKING:
            if not self._reasoning_begun:
                self._pending = self._pending.lstrip()
                self._reasoning_begun = bool(self._pending)
                if not self._pending:
                    return False
            end = self._pending.find(CLOSE)
            if end >= 0:
                reasoning.append(self._pending[:end].rstrip())
                self._pending = self._pending[end + len(CLOSE) :]
                self._state = State.CLOSED
                return True
            # Whitespace at the end may come before </think>, and the last characters begin it.
            sure = self._pending[: len(self._pending) - held_back(self._pending, CLOSE)].rstrip()
            reasoning.append(sure)
            self._pending = self._pending[len(sure) :]
            return False
        if self._state is State.CLOSED:
            self._pending = self._pending.lstrip()
            if not self._pending:
                return False
            self._state = State.ANSWERING
            return True
        answer.append(self._pending)
        self._pending = ""
        return False


class ThinksFirst(ThinkTags):
    """DeepSeek-R1's: the reply reasons until ``</think>``, whether ``<think>`` was written
    (in the reply or its prompt) or not."""

    reasons_first = True
