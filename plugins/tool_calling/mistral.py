"""Mistral's tool calls: after the ``[TOOL_CALLS]`` control token, either a JSON array of
``{"name", "arguments"}`` objects (the v3 tokenizer's format, Mistral 7B v0.3, Mixtral 8x22B)
or ``name[ARGS]{json}`` per call (the v11 tokenizer's, each call after its own
``[TOOL_CALLS]``). Text before the first ``[TOOL_CALLS]`` is content. Mistral's chat templates
take back only call ids of 9 letters and digits, so the calls get such ids.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Mapping, Sequence
from typing import Any

from nxdplug.plugins.serve.tool_calls import Parsed, ToolCall, held_back

MARKER = "[TOOL_CALLS]"
ARGUMENTS = "[ARGS]"
ID_ALPHABET = string.ascii_letters + string.digits


class MistralParser:
    keeps_special_tokens = True  # [TOOL_CALLS] and [ARGS] are control tokens

    def __init__(self, tools: Sequence[Mapping[str, Any]]) -> None:
        self._pending = ""
        self._calling = False  # past the first [TOOL_CALLS]
        self._decoder = json.JSONDecoder()

    @staticmethod
    def new_call_id() -> str:
        return "".join(secrets.choice(ID_ALPHABET) for _ in range(9))

    def feed(self, text: str) -> Parsed:
        self._pending += text
        if not self._calling:
            start = self._pending.find(MARKER)
            if start < 0:
                sure = len(self._pending) - held_back(self._pending, MARKER)
                content, self._pending = self._pending[:sure], self._pending[sure:]
                return Parsed(content=content)
            content = self._pending[:start].rstrip()
            self._pending = self._pending[start:]
            self._calling = True
            return Parsed(content, tuple(self._whole_calls()))
        return Parsed(calls=tuple(self._whole_calls()))

    def finish(self) -> Parsed:
        """What is left is no whole call: a call cut off, given back as written."""
        calls = self._whole_calls()
        content, self._pending = self._pending.strip(), ""
        return Parsed(content, tuple(calls))

    def _whole_calls(self) -> list[ToolCall]:
        """The calls the pending text holds whole, taken off it."""
        calls = []
        while True:
            rest = self._pending.lstrip()
            if rest.startswith(MARKER):
                rest = rest[len(MARKER) :].lstrip()
            if rest.startswith("["):  # v3: a JSON array of calls
                found = self._decoded(rest)
                if found is None:
                    return calls
                value, end = found
                try:
                    calls += [
                        ToolCall.of(item["name"], item.get("arguments", {})) for item in value
                    ]
                except (KeyError, TypeError, AttributeError, ValueError):
                    return calls  # JSON, but no calls: finish gives it back as written
            else:  # v11: name[ARGS]{json}
                name, separator, arguments = rest.partition(ARGUMENTS)
                found = self._decoded(arguments) if separator else None
                if found is None:
                    return calls
                value, end = found
                calls.append(ToolCall.of(name.strip(), value))
                end += len(rest) - len(arguments)
            self._pending = rest[end:]

    def _decoded(self, text: str) -> tuple[Any, int] | None:
        """The JSON value at the start of ``text`` and where it ends; None while it is not
        whole."""
        try:
            return self._decoder.raw_decode(text)
        except ValueError:
            return None
