"""OpenAI's response and stream-chunk bodies, built from the engine's outputs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs
from pydantic import BaseModel, ConfigDict

from nxdplug.plugin_api import RequestOutput
from nxdplug.plugins.prompt_logprobs.hooks import PROMPT_LOGPROBS

if TYPE_CHECKING:
    from nxdplug.plugins.prompt_logprobs.scores import PromptLogprob


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: the prompt tokens found in the prefix cache, not encoded again."""

    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, outputs: Sequence[RequestOutput], n: int = 1) -> Usage:
        """The usage of a request's choices (each one's last output, prompt by prompt, ``n``
        choices each): each prompt counted once, as OpenAI counts it (its cached tokens as its
        first choice found them)."""
        prompt = sum(output.prompt_tokens for output in outputs[::n])
        cached = sum(output.cached_tokens for output in outputs[::n])
        completion = sum(output.completion_tokens for output in outputs)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


class CompletionLogprobs(BaseModel):
    """The legacy format; ``top_logprobs``: each position's likeliest tokens as text ->
    logprob (null when ``logprobs`` was 0). With ``echo`` the prompt's tokens come first, the
    first one's entries null (nothing predicts it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    text_offset: list[int]
    top_logprobs: list[dict[str, float] | None] | None = None

    def then(self, later: CompletionLogprobs) -> CompletionLogprobs:
        """These positions followed by ``later``'s."""
        top = None
        if self.top_logprobs is not None and later.top_logprobs is not None:
            top = self.top_logprobs + later.top_logprobs
        return CompletionLogprobs(
            tokens=self.tokens + later.tokens,
            token_logprobs=self.token_logprobs + later.token_logprobs,
            text_offset=self.text_offset + later.text_offset,
            top_logprobs=top,
        )


class PromptTokenLogprob(BaseModel):
    """vLLM's entry of a prompt position: a token's logprob, rank (1: the likeliest) and text."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt position (null for the first), token id -> its entry
PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResultChoice(CompletionChoice):
    """A whole response's choice (not a stream chunk's): with vLLM's ``prompt_logprobs``."""

    prompt_logprobs: PromptLogprobs | None = None


class Completion(BaseModel):
    """A ``text_completion``: the whole response, or one stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionResult(Completion):
    """A whole ``text_completion`` response, whose choices may carry ``prompt_logprobs``."""

    choices: list[CompletionResultChoice]  # type: ignore[assignment]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str = ""  # JSON text


class ChatToolCall(BaseModel):
    """A call in an assistant message: the server's reply, or a request's earlier turn."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ChatToolCallDelta(BaseModel):
    """A stream's piece of call ``index``: its first piece has the id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ChatToolCall] | None = None
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


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
    tool_calls: list[ChatToolCallDelta] | None = None
    reasoning_content: str | None = None


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
    logprobs = top = None
    if last.logprobs is not None:
        logprobs = tuple(lp for o in outputs for lp in o.logprobs or ())
    if last.top_logprobs is not None:
        top = tuple(pairs for o in outputs for pairs in o.top_logprobs or ())
    return attrs.evolve(
        last,
        token_ids=tuple(t for o in outputs for t in o.token_ids),
        text="".join(o.text for o in outputs),
        logprobs=logprobs,
        top_logprobs=top,
        extras=outputs[0].extras,
    )


def completion_choice(
    index: int,
    output: RequestOutput,
    tokenizer: Any,
    offset: int = 0,
    echo: tuple[str, Sequence[int], int | None] | None = None,
) -> CompletionChoice:
    """A completion choice (or its stream chunk) from ``output``; ``offset``: characters of
    the choice before it. ``echo`` (the prompt's text, its ids, and the alternatives each
    position lists, None without logprobs) puts the prompt and its scores before the output's,
    for a choice's first output."""
    logprobs = completion_logprobs(output, tokenizer, offset + (len(echo[0]) if echo else 0))
    text = output.text
    if echo is not None:
        prompt_text, prompt_ids, alternatives = echo
        text = prompt_text + text
        scores = output.extra(PROMPT_LOGPROBS)
        if logprobs is not None and scores is not None:
            scored = prompt_completion_logprobs(
                scores, prompt_ids, tokenizer, offset, alternatives or 0
            )
            logprobs = scored.then(logprobs)
    return CompletionChoice(
        index=index, text=text, logprobs=logprobs, finish_reason=output.finish_reason
    )


def prompt_completion_logprobs(
    scores: Sequence[PromptLogprob | None],
    prompt_ids: Sequence[int],
    tokenizer: Any,
    offset: int,
    alternatives: int,
) -> CompletionLogprobs:
    """The prompt's positions in the legacy format (``echo``), ``alternatives`` a position."""
    tokens = [tokenizer.decode([t]) for t in prompt_ids]
    top = None
    if alternatives:
        top = [
            None
            if score is None
            else {tokenizer.decode([t]): lp for t, lp in score.top[:alternatives]}
            for score in scores
        ]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if score is None else score.logprob for score in scores],
        text_offset=_offsets(tokens, offset),
        top_logprobs=top,
    )


def vllm_prompt_logprobs(
    output: RequestOutput, tokenizer: Any, alternatives: int | None
) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs``: at each position the prompt's token and the
    ``alternatives`` likeliest, by token id; None when not asked."""
    scores = output.extra(PROMPT_LOGPROBS)
    if alternatives is None or scores is None:
        return None
    positions: PromptLogprobs = []
    for score in scores:
        if score is None:
            positions.append(None)
            continue
        entries = {
            str(score.token): _prompt_entry(tokenizer, score.token, score.logprob, score.rank)
        }
        for rank, (token, logprob) in enumerate(score.top[:alternatives], start=1):
            entries.setdefault(str(token), _prompt_entry(tokenizer, token, logprob, rank))
        positions.append(entries)
    return positions


def _offsets(tokens: Sequence[str], start: int) -> list[int]:
    """Where each token's text starts in the choice's text, the first at ``start``."""
    offsets = []
    for token in tokens:
        offsets.append(start)
        start += len(token)
    return offsets


def _prompt_entry(tokenizer: Any, token: int, logprob: float, rank: int) -> PromptTokenLogprob:
    return PromptTokenLogprob(logprob=logprob, rank=rank, decoded_token=tokenizer.decode([token]))


def completion_logprobs(
    output: RequestOutput, tokenizer: Any, offset: int = 0
) -> CompletionLogprobs | None:
    """The chosen tokens' log-probabilities; ``offset``: characters before this output."""
    if output.logprobs is None:
        return None
    tokens = [tokenizer.decode([t]) for t in output.token_ids]
    top = None
    if output.top_logprobs is not None:
        top = [
            {tokenizer.decode([token]): logprob for token, logprob in pairs}
            for pairs in output.top_logprobs
        ]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=list(output.logprobs),
        text_offset=_offsets(tokens, offset),
        top_logprobs=top,
    )


def chat_logprobs(output: RequestOutput, tokenizer: Any) -> ChatLogprobs | None:
    if output.logprobs is None:
        return None
    tops = output.top_logprobs or [()] * len(output.token_ids)
    content = []
    for token_id, logprob, top in zip(output.token_ids, output.logprobs, tops, strict=True):
        alternatives = [_top_logprob(tokenizer, t, lp) for t, lp in top]
        chosen = _top_logprob(tokenizer, token_id, logprob)
        content.append(TokenLogprob(**chosen.model_dump(), top_logprobs=alternatives))
    return ChatLogprobs(content=content)


def _top_logprob(tokenizer: Any, token_id: int, logprob: float) -> TopLogprob:
    token = tokenizer.decode([token_id])
    return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))
