"""OpenAI's Responses API (``POST /v1/responses``), served as a chat completion.

A request's ``instructions`` and ``input`` (a text, or items: messages, earlier function calls
and their outputs) become chat messages, its flat function tools and ``text.format`` the chat's
``tools`` and ``response_format``; the reply is read as a chat reply is (reasoning, content,
tool calls) and answered as output items: a ``reasoning`` item, a ``message`` with its
``output_text``, a ``function_call`` per call. Streamed, the items come as OpenAI's events
(``response.created``, ``response.output_item.added``, ``response.output_text.delta``, ...,
``response.completed``). Nothing is stored: ``store: true`` and ``previous_response_id`` are
refused, as is any field not declared here.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nxdplug.plugin_api import RequestOutput
from nxdplug.plugins.serve.engine_loop import OutputStream
from nxdplug.plugins.serve.protocol import ChatCompletionRequest, FunctionDefinition, bad_request
from nxdplug.plugins.serve.replies import ReplyReader, Told
from nxdplug.plugins.serve.responses import AssistantMessage, now

# The content parts that are text, of input messages.
TEXT_PARTS = ("input_text", "output_text")


class FunctionTool(FunctionDefinition):
    """The Responses API's function tool: chat's function definition, with its ``type`` beside
    it (flat, where chat nests it under ``function``)."""

    type: Literal["function"]


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None


class ResponseRequest(BaseModel):
    """``POST /v1/responses``: what this server honours of it."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(default=None, description="transformers serve's extra")
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    user: str | None = None

    def refuse_unsupported(self) -> None:
        if self.store:
            raise bad_request(
                "store", "this server keeps no responses; ask with store false (or leave it out)"
            )

    def as_chat(self) -> ChatCompletionRequest:
        """The chat completion that answers this request."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for index, item in enumerate(self.input):
                _add_item(messages, item, f"input.{index}")
        if not messages:
            raise bad_request("input", "give a text or at least one item")
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            chat["tools"] = [
                {
                    "type": "function",
                    "function": tool.model_dump(exclude={"type"}, exclude_none=True),
                }
                for tool in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunction):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type == "json_schema":
            schema = {"name": text_format.name or "output", "schema": text_format.schema_}
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif text_format is not None and text_format.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        return ChatCompletionRequest(**chat)


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """Append the chat message of one input item (or add its call to the assistant message
    before it)."""
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise bad_request(
                f"{where}.role", f"must be user, system, developer or assistant, got {role!r}"
            )
        messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call = {
            "id": _field(item, "call_id", where),
            "type": "function",
            "function": {
                "name": _field(item, "name", where),
                "arguments": _field(item, "arguments", where),
            },
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = _text(item.get("output"), f"{where}.output")
        messages.append(
            {"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": output}
        )
    else:
        raise bad_request(
            f"{where}.type",
            f"{kind!r} items are not supported by this server; give messages, function_call "
            "and function_call_output items",
        )


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{name}", f"must be a string, got {value!r}")
    return value


def _text(content: Any, where: str) -> str:
    """A text, or a list of text parts, as one text; other parts (images, files) are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(where, "must be a text or a list of text parts")
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else part
            raise bad_request(f"{where}.{index}", f"only text parts are supported, got {kind!r}")
        texts.append(_field(part, "text", f"{where}.{index}"))
    return "".join(texts)


class ResponseBuilder:
    """One response's object and, streamed, its events, from the chat reply's reader."""

    def __init__(
        self,
        request: ResponseRequest,
        request_id: str,
        model_name: str,
        tokenizer: Any,
        reader: ReplyReader,
    ) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.reader = reader
        suffix = request_id.removeprefix("req-")
        self.id = f"resp_{suffix}"
        self.reasoning_id = f"rs_{suffix}"
        self.message_id = f"msg_{suffix}"
        self.created_at = now()
        self.model_name = model_name
        self._sequence = itertools.count()
        self._items: list[dict[str, Any]] = []  # the output items opened so far, in order
        self._open: dict[str, Any] | None = None  # the item that the next delta may extend

    def whole(self, output: RequestOutput) -> dict[str, Any]:
        """The response to a request that was not streamed."""
        self.reader.take(output)
        return self._response(output)

    async def events(self, stream: OutputStream) -> AsyncIterator[dict[str, Any]]:
        """OpenAI's stream events of the response, ``response.completed`` last."""
        yield self._event("response.created", response=self._response(None))
        yield self._event("response.in_progress", response=self._response(None))
        last = None
        async for _, output in stream:
            for event in self._told(self.reader.take(output)):
                yield event
            last = output
        for event in self._close():
            yield event
        assert last is not None
        response = self._response(last)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield self._event(kind, response=response)

    def _response(self, output: RequestOutput | None) -> dict[str, Any]:
        """The response object: in progress (no output yet) or done with ``output``'s."""
        request = self.request
        status, incomplete, usage, items = "in_progress", None, None, []
        if output is not None:
            status = "incomplete" if output.finish_reason == "length" else "completed"
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
            message = self.reader.message()
            items = self._output_items(message)
            reasoning_tokens = self._tokens(message.reasoning_content or "")
            usage = {
                "input_tokens": output.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": output.prompt_tokens + output.completion_tokens,
            }
        text_format = request.text.format if request.text is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": self.model_name,
            "output": items,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "tool_choice": self.reader.use.choice
            if self.reader.use.choice != "function"
            else {"type": "function", "name": self.reader.use.function},
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or ()],
            "text": {
                "format": {"type": "text"}
                if text_format is None
                else text_format.model_dump(by_alias=True, exclude_none=True)
            },
            "metadata": request.metadata or {},
            "store": False,
            "usage": usage,
        }

    def _output_items(self, message: AssistantMessage) -> list[dict[str, Any]]:
        """The whole reply's items: its reasoning, its message, its calls."""
        items = []
        if message.reasoning_content:
            items.append(self._reasoning_item(message.reasoning_content, "completed"))
        if message.content or not message.tool_calls:
            items.append(self._message_item(message.content or "", "completed"))
        items += [
            self._call_item(call.id, call.function.name, call.function.arguments, "completed")
            for call in message.tool_calls or ()
        ]
        return items

    def _reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        content = [_part("reasoning", text)]
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "summary": [],
            "content": content,
            "status": status,
        }

    def _message_item(
        self, text: str | None, status: str, item_id: str | None = None
    ) -> dict[str, Any]:
        content = [] if text is None else [_part("message", text)]
        return {
            "type": "message",
            "id": item_id or self.message_id,
            "role": "assistant",
            "status": status,
            "content": content,
        }

    @staticmethod
    def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": f"fc_{call_id.removeprefix('call_')}",
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    def _tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids) if text else 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(self._sequence), **fields}

    # --- streaming: items opened, extended and closed as the reply is told ----------------

    def _told(self, told: Told) -> list[dict[str, Any]]:
        events = []
        if told.reasoning:
            events += self._extend("reasoning", told.reasoning)
        if told.content:
            events += self._extend("message", told.content)
        for call in told.calls:
            if call.id is not None:  # a new call
                events += self._close()
                item = self._call_item(call.id, call.function.name or "", "", "in_progress")
                events += self._add(item)
            events += self._extend("function_call", call.function.arguments or "")
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self._items.append(item)
        self._open = {"item": item, "index": len(self._items) - 1, "text": ""}
        events = [
            self._event(
                "response.output_item.added", output_index=self._open["index"], item=dict(item)
            )
        ]
        if item["type"] != "function_call":  # a message or reasoning: one text part
            where = {"item_id": item["id"], "output_index": self._open["index"]}
            part = _part(item["type"], "")
            events.append(
                self._event("response.content_part.added", **where, content_index=0, part=part)
            )
        return events

    def _extend(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["item"]["type"] != kind:
            events += self._close()
            if kind == "reasoning":
                events += self._add(self._reasoning_item("", "in_progress") | {"content": []})
            else:  # a second message (text after a call) gets an id of its own
                messages = sum(item["type"] == "message" for item in self._items)
                item_id = f"{self.message_id}_{messages}" if messages else None
                events += self._add(self._message_item(None, "in_progress", item_id))
        if not text:
            return events
        self._open["text"] += text
        delta_kind = {
            "reasoning": "response.reasoning_text.delta",
            "message": "response.output_text.delta",
            "function_call": "response.function_call_arguments.delta",
        }[kind]
        fields: dict[str, Any] = {
            "item_id": self._open["item"]["id"],
            "output_index": self._open["index"],
            "delta": text,
        }
        if kind != "function_call":
            fields["content_index"] = 0
        if kind == "message":
            fields["logprobs"] = []
        events.append(self._event(delta_kind, **fields))
        return events

    def _close(self) -> list[dict[str, Any]]:
        """The done events of the open item, if any."""
        if self._open is None:
            return []
        item, index, text = self._open["item"], self._open["index"], self._open["text"]
        self._open = None
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            done = self._call_item(item["call_id"], item["name"], text, "completed")
            events = [self._event("response.function_call_arguments.done", **where, arguments=text)]
        else:
            if item["type"] == "message":
                done = self._message_item(text, "completed", item["id"])
                text_done = self._event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                )
            else:
                done = self._reasoning_item(text, "completed")
                text_done = self._event(
                    "response.reasoning_text.done", **where, content_index=0, text=text
                )
            part = _part(item["type"], text)
            events = [
                text_done,
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]
        events.append(self._event("response.output_item.done", output_index=index, item=done))
        return events


def _part(kind: str, text: str) -> dict[str, Any]:
    """The text part of a ``message`` or ``reasoning`` item."""
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}
