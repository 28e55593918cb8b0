"""One chat reply, read as it streams: its reasoning, its content and its tool calls.

The whole answer and the stream are read by the same :class:`ReplyReader`, so both tell the
same. Reasoning comes first (:mod:`~nxdplug.plugins.serve.reasoning`); what follows it, the
answer, is content or calls as the request's ``tool_choice`` says
(:mod:`~nxdplug.plugins.serve.tool_calls`).
"""

from __future__ import annotations

import uuid

import attrs

from nxdplug.plugin_api import RequestOutput
from nxdplug.plugins.serve.reasoning import ReasoningSplitter, Split
from nxdplug.plugins.serve.responses import (
    AssistantMessage,
    ChatToolCall,
    ChatToolCallDelta,
    FunctionCall,
    FunctionCallDelta,
)
from nxdplug.plugins.serve.tool_calls import CallArray, Parsed, PlainText, ToolCallParser, ToolUse


@attrs.frozen
class Told:
    """What a piece of a reply tells: reasoning, content and pieces of calls."""

    reasoning: str = ""
    content: str = ""
    calls: tuple[ChatToolCallDelta, ...] = ()

    def tells_anything(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def then(self, later: Told) -> Told:
        return Told(
            self.reasoning + later.reasoning, self.content + later.content, self.calls + later.calls
        )


class ReplyReader:
    """One choice's reply, piece by piece: the stream's deltas as it goes, and the whole
    message at the end. ``tool_parser``: the server's parser, which ``"auto"`` needs (checked
    before); ``reasoning``: the server's reasoning splitter for this reply, if it has one."""

    def __init__(
        self,
        use: ToolUse,
        tool_parser: type | None = None,
        reasoning: ReasoningSplitter | None = None,
    ) -> None:
        self.use = use
        self.reasoning = reasoning
        self.new_call_id = getattr(tool_parser, "new_call_id", _call_id)
        self.parser: ToolCallParser
        if use.choice == "auto":
            assert tool_parser is not None
            self.parser = tool_parser(list(use.tools))
        elif use.choice == "required":
            self.parser = CallArray()
        else:
            self.parser = PlainText()
        self.thought: list[str] = []
        self.content: list[str] = []
        self.calls: list[ChatToolCall] = []

    def take(self, output: RequestOutput) -> Told:
        """What the engine's next output tells: its text read, and everything held back once
        it is the last (a whole answer is one output, finished)."""
        told = self.read(output.text) if output.text else Told()
        return told.then(self.finish()) if output.finished else told

    def read(self, text: str) -> Told:
        """What ``text``, the reply's next piece, tells."""
        split = Split(answer=text) if self.reasoning is None else self.reasoning.feed(text)
        return self._told(split, self._answer(split.answer))

    def finish(self) -> Told:
        """What the reply's readers held until its end."""
        split = Split() if self.reasoning is None else self.reasoning.finish()
        told = self._told(split, self._answer(split.answer))
        return told.then(self._told(Split(), self._calls(self.parser.finish())))

    def message(self) -> AssistantMessage:
        content = "".join(self.content)
        reasoning = "".join(self.thought) or None
        if self.calls and not content.strip():
            content = None
        return AssistantMessage(
            content=content, tool_calls=self.calls or None, reasoning_content=reasoning
        )

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: ``tool_calls`` when the model ended with calls it chose to make (a
        named function's call ends with ``stop``)."""
        if reason == "stop" and self.calls and self.use.choice in ("auto", "required"):
            return "tool_calls"
        return reason

    def _told(self, split: Split, answer: Told) -> Told:
        self.thought.append(split.reasoning)
        return Told(split.reasoning, answer.content, answer.calls)

    def _answer(self, text: str) -> Told:
        if not text:
            return Told()
        if self.use.choice == "function":
            return Told(calls=(self._arguments(text),))
        return self._calls(self.parser.feed(text))

    def _arguments(self, text: str) -> ChatToolCallDelta:
        """The named function's call, its arguments growing by ``text``."""
        if self.calls:
            self.calls[0].function.arguments += text
            return ChatToolCallDelta(index=0, function=FunctionCallDelta(arguments=text))
        function = FunctionCall(name=self.use.function or "", arguments=text)
        call = ChatToolCall(id=self.new_call_id(), function=function)
        self.calls.append(call)
        delta = FunctionCallDelta(name=function.name, arguments=text)
        return ChatToolCallDelta(index=0, id=call.id, type="function", function=delta)

    def _calls(self, parsed: Parsed) -> Told:
        self.content.append(parsed.content)
        deltas = []
        for found in parsed.calls:
            if self.calls and not self.use.parallel:
                break  # parallel_tool_calls=false: the first call only
            function = FunctionCall(name=found.name, arguments=found.arguments)
            call = ChatToolCall(id=self.new_call_id(), function=function)
            delta = FunctionCallDelta(name=found.name, arguments=found.arguments)
            index = len(self.calls)
            deltas.append(
                ChatToolCallDelta(index=index, id=call.id, type="function", function=delta)
            )
            self.calls.append(call)
        return Told(content=parsed.content, calls=tuple(deltas))


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
