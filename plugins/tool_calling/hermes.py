"""Hermes' tool-call format, which Hermes 2 Pro's and Qwen2/2.5's chat templates teach: each
call a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
``</tool_call>``; the text around the tags is content, less the whitespace that sets the tags
apart and ends the reply (as transformers' response template for Qwen2 reads it)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from nxdplug.plugins.serve.tool_calls import Parsed, ToolCall, held_back

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesParser:
    # Hermes 2 Pro's tags are special tokens: the reply's text must keep them (as vLLM's
    # hermes parser asks).
    keeps_special_tokens = True

    def __init__(self, tools: Sequence[Mapping[str, Any]]) -> None:
        self._pending = ""
        self._in_call = False
        self._after_call = False

    def feed(self, text: str) -> Parsed:
        self._pending += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_call:
                end = self._pending.find(CLOSE)
                if end < 0:
                    break
                body = self._pending[:end]
                self._pending = self._pending[end + len(CLOSE) :]
                self._in_call = False
                self._told_call(body, content, calls)
                continue
            start = self._pending.find(OPEN)
            if start >= 0:
                content.append(self._content(self._pending[:start].rstrip()))
                self._pending = self._pending[start + len(OPEN) :]
                self._in_call = True
                continue
            # Whitespace at the end may set a call apart, and the last characters may begin one.
            sure = self._pending[: len(self._pending) - held_back(self._pending, OPEN)].rstrip()
            content.append(self._content(sure))
            self._pending = self._pending[len(sure) :]
            break
        return Parsed("".join(content), tuple(calls))

    def finish(self) -> Parsed:
        content: list[str] = []
        calls: list[ToolCall] = []
        if self._in_call:  # a call the reply's end cut off: a call if its JSON is whole
            self._told_call(self._pending, content, calls, closed=False)
        else:  # whitespace at the reply's end is no content, as transformers parses it
            content.append(self._content(self._pending.rstrip()))
        self._pending = ""
        return Parsed("".join(content), tuple(calls))

    def _content(self, text: str) -> str:
        """Content, less the whitespace between a call and the text after it."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text

    def _told_call(
        self, body: str, content: list[str], calls: list[ToolCall], closed: bool = True
    ) -> None:
        """The call between the tags, or the tags and their text as content when it is none."""
        try:
            value = json.loads(body)
            calls.append(ToolCall.of(value["name"], value.get("arguments", {})))
            self._after_call = True
        except (ValueError, KeyError, TypeError):
            content.append(OPEN + body + (CLOSE if closed else ""))
