"""Reasoning in chat replies: the thinking some models write before their answer (Qwen3's and
DeepSeek-R1's ``<think>...</think>``), answered apart as ``reasoning_content`` (the field of
vLLM and ``transformers serve``) by a server started with ``--reasoning-parser NAME`` (a
``nxdplug_reasoning_parsers`` record). A reply held to a structured output (``tool_choice``
``required`` or a function, ``response_format``, ``structured_outputs``) is all answer: its
constraint holds from its first token, so it has no room to reason.
"""

from __future__ import annotations

from typing import Protocol

import attrs


@attrs.frozen
class Split:
    """What a piece of a reply tells for sure: reasoning text, and answer text."""

    reasoning: str = ""
    answer: str = ""


class ReasoningSplitter(Protocol):
    """Tells one reply's reasoning from its answer as the text comes (a ``ReasoningParser``
    record's implementation, built with the prompt's text once per reply).

    ``feed`` takes the next piece of text and returns what is sure by now, holding back text
    that may begin or end the reasoning; ``finish`` returns the rest once the reply has ended.
    """

    def feed(self, text: str) -> Split: ...

    def finish(self) -> Split: ...
