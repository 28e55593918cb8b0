"""OpenAI's request bodies, what this server honours of them, and its error body.

Besides OpenAI's fields, vLLM's extras ``top_k``, ``min_p``, ``min_tokens``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``,
``prompt_logprobs`` and ``structured_outputs`` (and the older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``) are honoured, as is OpenAI's
``response_format``. A field that would change the result but is not implemented
(``best_of``, ``suffix``, and any field not declared here) is refused with a 400 naming it,
never silently ignored. Chat completions take ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (see :mod:`~nxdplug.plugins.serve.tool_calls`). ``n`` choices are ``n``
requests of the engine for the same prompt. ``echo`` with ``logprobs`` and
``prompt_logprobs`` need a model that scores prompts (``--enable-prompt-logprobs``); the
engine refuses them otherwise.
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nxdplug.plugin_api import MAX_TOP_LOGPROBS, SamplingSettings
from nxdplug.plugins.serve.responses import ChatToolCall
from nxdplug.plugins.serve.tool_calls import ToolUse

# OpenAI's bound on ``n``, and this server's on the prompts of one completion request.
MAX_CHOICES = 128
MAX_PROMPTS = 128
# The JSON schema of ``response_format: {"type": "json_object"}``: any object.
ANY_OBJECT = '{"type": "object"}'

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error answered with OpenAI's body: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, str(self), param=self.param, code=self.code)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    error_type = ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "APIError")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON of a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of a JSON schema, a regex, choices or a grammar."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _GenerationRequest(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, description="vLLM's extra: 0 or -1 is off")
    min_p: float | None = Field(default=None, description="vLLM's extra: 0 is off")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, description="vLLM's extra")
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = Field(default=True, description="vLLM's extra")
    cache_salt: str | None = Field(
        default=None,
        description="vLLM's extra: prompts share cached positions only under the same salt",
    )
    min_tokens: int = Field(default=0, description="vLLM's extra")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(default=None, description="vLLM's extra")
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = Field(default=None, description="vLLM's extra")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(default=None, description="vLLM's")
    guided_json: dict[str, Any] | str | None = Field(default=None, description="vLLM's, older")
    guided_regex: str | None = Field(default=None, description="vLLM's, older")
    guided_choice: list[str] | None = Field(default=None, description="vLLM's, older")
    guided_grammar: str | None = Field(default=None, description="vLLM's, older")
    user: str | None = None

    def refuse_unsupported(self) -> None:
        """Raise a 400 for the first field whose value this server cannot honour."""
        for field, value, default in self._unsupported_fields():
            if value not in (None, default):
                raise bad_request(field, f"{value!r} is not supported by this server")
        if not 1 <= self.choices <= MAX_CHOICES:
            raise bad_request("n", f"must be in [1, {MAX_CHOICES}], got {self.n}")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request(
                "prompt_logprobs",
                "is not supported with stream=true; ask without streaming (or, for "
                "completions, use echo with logprobs, which streams the prompt first)",
            )

    @property
    def choices(self) -> int:
        return 1 if self.n is None else self.n

    def _unsupported_fields(self) -> list[tuple[str, Any, Any]]:
        return []

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_settings(
        self,
        max_tokens: int,
        logprobs: bool,
        top_logprobs: int = 0,
        prompt_logprobs: int | None = None,
    ) -> SamplingSettings:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        structured = self.structured_output()
        return SamplingSettings(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=stop,
            stop_token_ids=self.stop_token_ids or (),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            min_tokens=self.min_tokens,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=self._logit_bias(),
            prompt_logprobs=prompt_logprobs,
            structured_output=None if structured is None else structured[1],
            skip_special_tokens=self.skip_special_tokens,
        )

    def structured_output(self) -> tuple[str, tuple[str, str]] | None:
        """The field that asks for a structured output, and its ``(kind, spec)``; None when
        none does. Two at once are a 400."""
        asked = []
        response_format = self.response_format
        if response_format is not None and response_format.type == "json_object":
            asked.append(("response_format", ("json", ANY_OBJECT)))
        elif response_format is not None and response_format.type == "json_schema":
            if response_format.json_schema is None or response_format.json_schema.schema_ is None:
                raise bad_request(
                    "response_format", "type json_schema needs json_schema.schema, the schema"
                )
            schema = json.dumps(response_format.json_schema.schema_)
            asked.append(("response_format", ("json", schema)))
        given = self.structured_outputs
        if given is not None:
            kinds = _kinds(given.json_, given.regex, given.choice, given.grammar)
            asked += [("structured_outputs", kind) for kind in kinds]
            if given.json_object:
                asked.append(("structured_outputs", ("json", ANY_OBJECT)))
        legacy = _kinds(
            self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar
        )
        asked += [(f"guided_{kind}", (kind, spec)) for kind, spec in legacy]
        asked += self._asked_by_tools()
        if len(asked) > 1:
            names = ", ".join(dict.fromkeys(field for field, _ in asked))
            raise bad_request(
                asked[1][0], f"one structured output at a time; this request asks in {names}"
            )
        return asked[0] if asked else None

    def _asked_by_tools(self) -> list[tuple[str, tuple[str, str]]]:
        return []

    def _logit_bias(self) -> list[tuple[int, float]]:
        """OpenAI's ``{"token id": bias}`` as (id, bias) pairs."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                pairs.append((int(key), bias))
            except ValueError:
                raise bad_request(
                    "logit_bias", f"keys are token ids, as strings of digits; got {key!r}"
                ) from None
        return pairs


def _kinds(
    json_schema: dict[str, Any] | str | None,
    regex: str | None,
    choice: list[str] | None,
    grammar: str | None,
) -> list[tuple[str, str]]:
    """The ``(kind, spec)`` of each constraint given (a schema may come as JSON text)."""
    found = []
    if json_schema is not None:
        spec = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        found.append(("json", spec))
    if regex is not None:
        found.append(("regex", regex))
    if choice is not None:
        found.append(("choice", json.dumps(choice)))
    if grammar is not None:
        found.append(("grammar", grammar))
    return found


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: one prompt or a batch, as text or token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def _unsupported_fields(self) -> list[tuple[str, Any, Any]]:
        return [
            *super()._unsupported_fields(),
            ("suffix", self.suffix, None),
            ("best_of", self.best_of, 1),
        ]

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(
                "logprobs",
                f"the likeliest tokens listed at each position: must be in "
                f"[0, {MAX_TOP_LOGPROBS}] (got {self.logprobs})",
            )

    def prompts(self, tokenizer: Any) -> list[list[int]]:
        """The prompts as token ids: one text or a list of texts, one list of token ids or a
        list of them."""
        prompt = self._prompt_list()
        if len(prompt) > MAX_PROMPTS:
            raise bad_request("prompt", f"at most {MAX_PROMPTS} prompts, got {len(prompt)}")
        return [tokenizer(p).input_ids if isinstance(p, str) else list(p) for p in prompt]

    def echoed_texts(self, tokenizer: Any, prompts: list[list[int]]) -> list[str] | None:
        """With ``echo``, the text each prompt's choices begin with: the prompt as given, or
        its token ids decoded."""
        if not self.echo:
            return None
        return [
            p if isinstance(p, str) else tokenizer.decode(ids)
            for p, ids in zip(self._prompt_list(), prompts, strict=True)
        ]

    def _prompt_list(self) -> list[Any]:
        """The prompts, each a text or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    def settings(self) -> SamplingSettings:
        """16 tokens unless asked, OpenAI's default for completions. ``echo`` with ``logprobs``
        scores the prompt with as many alternatives a position."""
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return self.sampling_settings(
            max_tokens,
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
            prompt_logprobs=prompt_logprobs,
        )


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message with text content, an assistant's calls, or a tool's result; images are
    refused (extra fields)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: a call's arguments as an object (HF's
        templates write them with ``tojson``), as vLLM gives them."""
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": call.type,
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments_object(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def problem(self) -> tuple[str, str] | None:
        """The field that is wrong for this message's role, and why."""
        if self.tool_calls is not None and self.role != "assistant":
            return "tool_calls", f"only an assistant message makes calls, not a {self.role} one"
        if self.role == "tool" and self.tool_call_id is None:
            return "tool_call_id", "a tool message answers a call; give that call's id"
        return None


def _arguments_object(arguments: str) -> Any:
    """A call's arguments as the object their JSON text holds (the text if it holds none)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: messages rendered by the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="vLLM's extra: variables of the chat template"
    )
    add_generation_prompt: bool = Field(default=True, description="vLLM's extra")
    continue_final_message: bool = Field(
        default=False, description="vLLM's extra: the reply continues the last message"
    )

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for index, message in enumerate(self.messages):
            problem = message.problem()
            if problem is not None:
                raise bad_request(f"messages.{index}.{problem[0]}", problem[1])
        self.tool_use()

    def tool_use(self) -> ToolUse:
        """How this request uses its tools (OpenAI's default: ``auto`` with tools, ``none``
        without); a 400 for a choice its tools cannot meet."""
        tools = tuple(tool.model_dump(exclude_none=True) for tool in self.tools or ())
        names = [tool["function"]["name"] for tool in tools]
        for name in names:
            if names.count(name) > 1:
                raise bad_request("tools", f"two functions are named {name!r}")
        choice = self.tool_choice or ("auto" if tools else "none")
        parallel = self.parallel_tool_calls is not False
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise bad_request(
                    "tool_choice",
                    f"names the function {choice.function.name!r}, which is not among the "
                    f"tools ({', '.join(map(repr, names)) or 'none given'})",
                )
            return ToolUse("function", tools, choice.function.name, parallel)
        if choice != "none" and not tools:
            raise bad_request("tool_choice", f"{choice!r} needs tools; none are given")
        return ToolUse(choice, tools, parallel=parallel)

    def _template_variables(self, tokenizer: Any) -> dict[str, Any]:
        """``chat_template_kwargs`` (``enable_thinking``, ...), which the template reads as
        variables; one that would set ``apply_chat_template``'s own arguments is a 400."""
        variables = self.chat_template_kwargs or {}
        own = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
        for name in variables:
            if name in own:
                raise bad_request(
                    "chat_template_kwargs",
                    f"{name!r} is an argument of apply_chat_template that the server sets, "
                    "not a template variable (add_generation_prompt and "
                    "continue_final_message are fields of the request)",
                )
        return variables

    def _asked_by_tools(self) -> list[tuple[str, tuple[str, str]]]:
        constraint = self.tool_use().constraint()
        return [] if constraint is None else [("tool_choice", constraint)]

    def prompt_text(self, tokenizer: Any) -> str:
        """The messages (and tools, if any) as the tokenizer's chat template writes them; a
        400 when it has none, refuses them, or leaves the tools out."""
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request(
                "messages",
                "this model's tokenizer has no chat template (tokenizer_config.json "
                "chat_template); use /v1/completions with a prompt",
            )
        messages = [message.template_dict() for message in self.messages]
        tools = list(self.tool_use().tools) or None
        if self.add_generation_prompt and self.continue_final_message:
            raise bad_request(
                "continue_final_message",
                "continues the last message, while add_generation_prompt starts a new one; "
                "set add_generation_prompt to false",
            )
        variables = self._template_variables(tokenizer) | {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }
        text = _rendered(tokenizer, messages, tools, variables)
        if tools is not None and text == _rendered(tokenizer, messages, None, variables):
            raise bad_request(
                "tools",
                "this model's chat template does not write tools into the prompt, so the "
                "model would not see them; leave tools out, or serve a model whose template "
                "takes them",
            )
        return text

    def settings(self, prompt_tokens: int, seq_len: int) -> SamplingSettings:
        """Unless asked, as many tokens as the model's positions leave after the prompt."""
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = max(seq_len - prompt_tokens, 1)
        return self.sampling_settings(
            max_tokens,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs or 0,
            prompt_logprobs=self.prompt_logprobs,
        )


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a prompt as completions tokenize it, or messages (and tools)
    as chat completions render and tokenize them."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    def token_ids(self, tokenizer: Any) -> list[int]:
        """The ids that a completion of ``prompt`` or a chat of ``messages`` would be given
        (special tokens added to a prompt unless ``add_special_tokens`` is false; to messages
        only if it is true, as the chat template writes its own)."""
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("prompt", "give a prompt or messages, one of them")
        if self.prompt is not None:
            special = self.add_special_tokens is not False
            return tokenizer(self.prompt, add_special_tokens=special).input_ids
        chat = ChatCompletionRequest(
            model=self.model or "",
            messages=self.messages,
            tools=self.tools,
            tool_choice="none" if self.tools else None,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=self.chat_template_kwargs,
        )
        chat.refuse_unsupported()
        text = chat.prompt_text(tokenizer)
        return tokenizer(text, add_special_tokens=bool(self.add_special_tokens)).input_ids


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def _rendered(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[Any] | None,
    variables: dict[str, Any],
) -> str:
    """The chat template's text; ``variables``: the template's, and how the text ends
    (``add_generation_prompt``, ``continue_final_message``)."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **variables)
    except Exception as exc:  # the template's own raise_exception, or a Jinja error
        raise bad_request("messages", f"the chat template refused them: {exc}") from exc
