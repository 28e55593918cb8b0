"""Tool calls in chat completions: OpenAI's ``tools`` and ``tool_choice``, as vLLM serves them.

What makes a reply's text into calls depends on ``tool_choice``:

- ``"auto"``: the model chooses, writing calls in its family's format; the parser that
  ``nxdplug serve --tool-call-parser NAME`` names (a ``nxdplug_tool_parsers`` record) finds
  them. A server started without one refuses ``"auto"``.
- ``"required"``: the reply is held (a structured output) to a JSON array of
  ``{"name": ..., "parameters": ...}`` objects, at least one, each a declared function.
- a named function: the reply is held to that function's parameters schema; it is the call's
  arguments.
- ``"none"``: the tools are in the prompt and the reply is text.

A :class:`~nxdplug.plugins.serve.replies.ReplyReader` reads each choice with these as it streams,
so that the whole answer and the stream tell the same content and calls.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

import attrs


@attrs.frozen
class ToolCall:
    """A call as a parser finds it: the function's name and its arguments as JSON text."""

    name: str
    arguments: str

    @classmethod
    def of(cls, name: Any, arguments: Any) -> ToolCall:
        """A call from parsed JSON; ``arguments`` given as an object or as its JSON text."""
        if not isinstance(name, str):
            raise ValueError(f"a call's name is a string, got {name!r}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return cls(name, arguments)


@attrs.frozen
class Parsed:
    """What a piece of a reply tells for sure: content text, and the calls it completes."""

    content: str = ""
    calls: tuple[ToolCall, ...] = ()


class ToolCallParser(Protocol):
    """Finds the tool calls in one reply's text as it comes (a ``ToolParser`` record's
    implementation, built with the request's ``tools`` in OpenAI's form).

    ``feed`` takes the next piece of text and returns what is sure by now, holding back text
    that may begin a call; ``finish`` returns the rest once the reply has ended. The pieces'
    contents, joined, are the reply's content. A class that sets ``keeps_special_tokens``
    gets the text with the model's special tokens in it (where its format's markers are
    special tokens); one with a static ``new_call_id()`` names the calls of the server's
    replies with it (Mistral's chat templates take back only 9-character ids).
    """

    def feed(self, text: str) -> Parsed: ...

    def finish(self) -> Parsed: ...


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` begin ``marker``: text a parser must hold
    until the next piece tells whether ``marker`` follows."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


class PlainText:
    """The reply of a request without tools, or with ``tool_choice: "none"``: all content."""

    def feed(self, text: str) -> Parsed:
        return Parsed(content=text)

    def finish(self) -> Parsed:
        return Parsed()


class CallArray:
    """The reply of ``tool_choice: "required"``: a JSON array of ``{"name", "parameters"}``
    objects; a call is told as its object closes. An object that the reply's end cuts off (its
    tokens ran out) is no call."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._item: list[str] = []

    def feed(self, text: str) -> Parsed:
        calls = []
        for char in text:
            if self._depth >= 2 or (self._depth == 1 and char == "{"):
                self._item.append(char)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 1 and char == "}":
                    item = json.loads("".join(self._item))
                    calls.append(ToolCall.of(item["name"], item["parameters"]))
                    self._item = []
        return Parsed(calls=tuple(calls))

    def finish(self) -> Parsed:
        return Parsed()


@attrs.frozen
class ToolUse:
    """How a request uses its tools: ``choice`` one of ``none``, ``auto``, ``required`` or
    ``function`` (then ``function`` names it); ``tools`` in OpenAI's form."""

    choice: str
    tools: tuple[Mapping[str, Any], ...] = ()
    function: str | None = None
    parallel: bool = True

    def constraint(self) -> tuple[str, str] | None:
        """The structured output that makes the reply a call: ``("json", schema)``; None when
        the model chooses."""
        if self.choice == "function":
            return "json", json.dumps(self._parameters(self.function))
        if self.choice == "required":
            return "json", json.dumps(self._call_array_schema())
        return None

    def _parameters(self, name: str | None) -> Mapping[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or {"type": "object"}
        raise KeyError(name)

    def _call_array_schema(self) -> dict[str, Any]:
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["function"]["name"]},
                    "parameters": self._parameters(tool["function"]["name"]),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in self.tools
        ]
        schema = {
            "type": "array",
            "minItems": 1,
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        }
        return schema if self.parallel else schema | {"maxItems": 1}
