"""OpenAI's response and stream-chunk bodies, built from the engine's outputs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel

from nxdplug.engine import RequestOutput


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, output: RequestOutput) -> Usage:
        total = output.prompt_tokens + output.completion_tokens
        return cls(
            prompt_tokens=output.prompt_tokens,
            completion_tokens=output.completion_tokens,
            total_tokens=total,
        )


class CompletionLogprobs(BaseModel):
    """The legacy format; ``top_logprobs`` stays null: no alternatives are computed."""

    tokens: list[str]
    token_logprobs: list[float]
    text_offset: list[int]
    top_logprobs: None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """A ``text_completion``: the whole response, or one stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[Any] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


def now() -> int:
    return int(time.time())


def merged(outputs: Sequence[RequestOutput]) -> RequestOutput:
    """A request's outputs as one (all tokens, text and logprobs; the last's counts)."""
    last = outputs[-1]
    logprobs = None
    if last.logprobs is not None:
        logprobs = tuple(lp for o in outputs for lp in o.logprobs or ())
    return RequestOutput(
        request_id=last.request_id,
        token_ids=tuple(t for o in outputs for t in o.token_ids),
        text="".join(o.text for o in outputs),
        logprobs=logprobs,
        finished=last.finished,
        finish_reason=last.finish_reason,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
    )


def completion_logprobs(
    output: RequestOutput, tokenizer: Any, offset: int = 0
) -> CompletionLogprobs | None:
    """The chosen tokens' log-probabilities; ``offset``: characters before this output."""
    if output.logprobs is None:
        return None
    tokens = [tokenizer.decode([t]) for t in output.token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=list(output.logprobs), text_offset=offsets
    )


def chat_logprobs(output: RequestOutput, tokenizer: Any) -> ChatLogprobs | None:
    if output.logprobs is None:
        return None
    content = []
    for token_id, logprob in zip(output.token_ids, output.logprobs, strict=True):
        token = tokenizer.decode([token_id])
        content.append(TokenLogprob(token=token, logprob=logprob, bytes=list(token.encode())))
    return ChatLogprobs(content=content)
