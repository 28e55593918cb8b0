"""Llama 3.1-3.3's JSON tool calls (their chat templates' JSON-based tool calling): a reply
that is a call is a JSON object ``{"name": ..., "parameters": {...}}`` (written after
``<|python_tag|>``, a special token the reply's text leaves out), several separated by ``;``.
A reply that begins with anything but ``{`` is content."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from nxdplug.plugins.serve.tool_calls import Parsed, ToolCall

SEPARATORS = " \t\r\n;"


class Llama3JsonParser:
    def __init__(self, tools: Sequence[Mapping[str, Any]]) -> None:
        self._pending = ""
        self._calls: bool | None = None  # None until the reply's first character tells
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> Parsed:
        if self._calls is False:
            return Parsed(content=text)
        self._pending += text
        if self._calls is None:
            begun = self._pending.lstrip()
            if not begun:
                return Parsed()
            self._calls = begun.startswith("{")
            if not self._calls:
                content, self._pending = self._pending, ""
                return Parsed(content=content)
        calls = tuple(self._whole_calls())
        if self._calls is False:  # JSON, but no call: the rest of the reply is content
            content, self._pending = self._pending, ""
            return Parsed(content=content, calls=calls)
        return Parsed(calls=calls)

    def finish(self) -> Parsed:
        """What is left is no call: an object cut off, or text after the calls."""
        content, self._pending = self._pending.lstrip(SEPARATORS), ""
        return Parsed(content=content)

    def _whole_calls(self) -> list[ToolCall]:
        calls = []
        while True:
            rest = self._pending.lstrip(SEPARATORS)
            try:
                value, end = self._decoder.raw_decode(rest)
            except ValueError:
                return calls  # not whole yet (or never: then finish gives it as content)
            if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
                self._calls = False
                return calls
            arguments = value.get("parameters", value.get("arguments", {}))
            calls.append(ToolCall.of(value["name"], arguments))
            self._pending = rest[end:]
