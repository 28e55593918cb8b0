"""The HTTP layer: OpenAI's routes over an :class:`~nxdplug.plugins.serve.engine_loop.EngineLoop`.

A route checks the request, turns it into prompt ids and sampling settings, hands it to the
engine loop and returns (or streams, as server-sent events) what comes back. Scheduling,
batching and cancellation are the engine's; a request whose client goes away is aborted, which
frees its KV-cache line: a streamed one when its stream is cancelled, a non-streamed one when
the server sees the connection close while it waits for the whole answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import attrs
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from nxdplug.plugin_api import (
    EngineFullError,
    NxdPlugError,
    RequestError,
    RequestOutput,
    get_registry,
)
from nxdplug.plugins.serve.engine_loop import EngineLoop, EngineStoppedError, OutputStream
from nxdplug.plugins.serve.metrics import ServingMetrics
from nxdplug.plugins.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    bad_request,
    error_body,
)
from nxdplug.plugins.serve.replies import ReplyReader
from nxdplug.plugins.serve.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionResult,
    CompletionResultChoice,
    Usage,
    chat_logprobs,
    completion_choice,
    merged,
    now,
    vllm_prompt_logprobs,
)
from nxdplug.plugins.serve.responses_api import ResponseBuilder, ResponseRequest

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


def build_app(
    engine_loop: EngineLoop,
    tokenizer: Any,
    model_name: str,
    metrics: ServingMetrics,
    tool_parser: type | None = None,
    reasoning_parser: type | None = None,
) -> FastAPI:
    """The server's app; ``model_name`` is the one name requests may give as ``model``;
    ``tool_parser`` finds the calls of ``tool_choice: "auto"`` (a ``ToolParser`` record's
    implementation), which is refused without one; ``reasoning_parser`` tells a chat reply's
    reasoning from its answer (a ``ReasoningParser`` record's)."""
    app = FastAPI(title="nxdplug")
    seq_len = engine_loop.engine.max_positions
    _add_error_handlers(app)

    def variants() -> dict[str, dict[str, Any]]:
        """The names a plugin serves beside the base model (adapters), each with the
        step keywords of a request naming it."""
        served = engine_loop.engine.inputs.served_names()
        served.pop(model_name, None)  # the base model's own name means the base model
        return served

    def step_keywords_of(name: str) -> dict[str, Any]:
        """What a request naming ``name`` as its model carries to the engine."""
        if name == model_name:
            return {}
        served = variants()
        if name not in served:
            raise not_served(name)
        return served[name]

    def not_served(name: str) -> OpenAIError:
        names = ", ".join(f"`{n}`" for n in [model_name, *variants()])
        return OpenAIError(
            404,
            f"The model `{name}` does not exist; this server serves {names}",
            param="model",
            code="model_not_found",
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parsed(request, CompletionRequest)

        def prepare() -> tuple[dict[str, Any], list[list[int]], Any, list[str] | None]:
            keywords = step_keywords_of(body.model)
            body.refuse_unsupported()
            prompts = body.prompts(tokenizer)
            with _named_as_asked(body):
                settings = body.settings()
            return keywords, prompts, settings, body.echoed_texts(tokenizer, prompts)

        keywords, prompts, settings, echoes = await off_loop(prepare)
        with _named_as_asked(body):
            stream = await engine_loop.generate_batch(
                prompts, settings, body.choices, keywords, body.cache_salt
            )
        reply_id = "cmpl-" + stream.request_id.removeprefix("req-")
        head = {"id": reply_id, "created": now(), "model": model_name}

        def echo(index: int) -> tuple[str, list[int], int | None] | None:
            """What choice ``index`` echoes (its prompt is ``index // n``)."""
            if echoes is None:
                return None
            prompt = index // body.choices
            return echoes[prompt], prompts[prompt], body.logprobs

        if body.stream:
            usage = body.include_usage()
            chunks = _completion_chunks(stream, head, tokenizer, usage, body.choices, echo)
            return _event_stream(chunks)
        outputs = await _whole_answer(request, stream)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices = [
            CompletionResultChoice(
                **dict(completion_choice(index, output, tokenizer, echo=echo(index))),
                prompt_logprobs=vllm_prompt_logprobs(output, tokenizer, body.prompt_logprobs),
            )
            for index, output in enumerate(outputs)
        ]
        usage = Usage.of(outputs, body.choices)
        return _json(CompletionResult(**head, choices=choices, usage=usage))

    def prepare_chat(body: ChatCompletionRequest) -> tuple[Any, str, list[int], Any, Any]:
        """The chat's step keywords, prompt (text and ids) and sampling settings, and its tool
        use; the slow part of a chat request (its template, its tokens), run off the loop."""
        keywords = step_keywords_of(body.model)
        body.refuse_unsupported()
        use = body.tool_use()
        if use.choice == "auto" and tool_parser is None:
            raise bad_request(
                "tool_choice",
                "'auto' (the default when tools are given) needs a server started with "
                "--enable-auto-tool-choice --tool-call-parser NAME; or ask for 'none', "
                "'required' or a named function",
            )
        prompt = body.prompt_text(tokenizer)
        prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
        settings = body.settings(len(prompt_ids), seq_len)
        if use.choice == "auto" and getattr(tool_parser, "keeps_special_tokens", False):
            settings = attrs.evolve(settings, skip_special_tokens=False)
        return keywords, prompt, prompt_ids, settings, use

    async def start_chat(body: ChatCompletionRequest) -> tuple[OutputStream, list[ReplyReader]]:
        """The chat's requests queued, and a reader of each choice's reply."""
        keywords, prompt, prompt_ids, settings, use = await off_loop(prepare_chat, body)
        with _named_as_asked(body):
            stream = await engine_loop.generate(
                prompt_ids, settings, body.choices, keywords, body.cache_salt
            )
        thinks = reasoning_parser is not None and settings.structured_output is None

        def reader() -> ReplyReader:
            reasoning = reasoning_parser(prompt) if thinks else None
            return ReplyReader(use, tool_parser, reasoning)

        return stream, [reader() for _ in range(body.choices)]

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _parsed(request, ChatCompletionRequest)
        stream, readers = await start_chat(body)
        reply_id = "chatcmpl-" + stream.request_id.removeprefix("req-")
        head = {"id": reply_id, "created": now(), "model": model_name}
        if body.stream:
            chunks = _chat_chunks(stream, head, tokenizer, body.include_usage(), readers)
            return _event_stream(chunks)
        outputs = await _whole_answer(request, stream)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices = []
        for index, (output, reader) in enumerate(zip(outputs, readers, strict=True)):
            reader.take(output)
            choice = ChatChoice(
                index=index,
                message=reader.message(),
                logprobs=chat_logprobs(output, tokenizer),
                finish_reason=reader.finish_reason(output.finish_reason),
                prompt_logprobs=vllm_prompt_logprobs(output, tokenizer, body.prompt_logprobs),
            )
            choices.append(choice)
        return _json(ChatCompletion(**head, choices=choices, usage=Usage.of(outputs, body.choices)))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = await _parsed(request, ResponseRequest)
        body.refuse_unsupported()
        stream, (reader,) = await start_chat(await off_loop(body.as_chat))
        reply = ResponseBuilder(body, stream.request_id, model_name, tokenizer, reader)
        if body.stream:
            return _event_stream(reply.events(stream), named_events=True)
        outputs = await _whole_answer(request, stream)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(reply.whole(outputs[0]))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await _parsed(request, TokenizeRequest)

        def answer() -> dict[str, Any]:
            if body.model is not None:
                step_keywords_of(body.model)
            ids = body.token_ids(tokenizer)
            answer: dict[str, Any] = {"count": len(ids), "max_model_len": seq_len, "tokens": ids}
            if body.return_token_strs:
                answer["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
            return answer

        return JSONResponse(await off_loop(answer))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await _parsed(request, DetokenizeRequest)

        def answer() -> dict[str, Any]:
            if body.model is not None:
                step_keywords_of(body.model)
            vocabulary = engine_loop.engine.vocab_size or len(tokenizer)
            if any(not 0 <= token < vocabulary for token in body.tokens):
                raise bad_request("tokens", f"token ids are in [0, {vocabulary})")
            return {"prompt": tokenizer.decode(body.tokens)}

        return JSONResponse(await off_loop(answer))

    def model_cards() -> list[dict[str, Any]]:
        card = {
            "object": "model",
            "created": now(),
            "owned_by": "nxdplug",
            "max_model_len": seq_len,
        }
        cards = [card | {"id": model_name}]
        return cards + [card | {"id": name, "parent": model_name} for name in variants()]

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": model_cards()})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        cards = {card["id"]: card for card in model_cards()}
        if model not in cards:
            raise not_served(model)
        return JSONResponse(cards[model])

    _add_plugin_routes(app, engine_loop)

    @app.get("/health")
    async def health() -> Response:
        if engine_loop.is_serving():
            return Response(status_code=200)
        return JSONResponse(error_body(503, "the engine is not running"), status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        content, content_type = metrics.render()
        return Response(content, media_type=content_type)

    return app


# The status a request gets when its client left before the answer (nginx's; nobody reads it).
CLIENT_CLOSED_REQUEST = 499


@contextlib.contextmanager
def _named_as_asked(body: CompletionRequest | ChatCompletionRequest) -> Iterator[None]:
    """A refused structured output as an error of the request field that asked for it."""
    try:
        yield
    except RequestError as exc:
        asked = body.structured_output()
        if exc.field != "structured_output" or asked is None:
            raise
        raise OpenAIError(400, f"{asked[0]}: {exc}", param=asked[0]) from None


async def _all(stream: OutputStream) -> list[RequestOutput]:
    """Each choice's outputs merged into one, in choice order."""
    by_choice: dict[int, list[RequestOutput]] = {}
    async for index, output in stream:
        by_choice.setdefault(index, []).append(output)
    return [merged(by_choice[index]) for index in sorted(by_choice)]


async def _whole_answer(request: Request, stream: OutputStream) -> list[RequestOutput] | None:
    """Each choice's outputs merged into one, or None if the client closes the connection
    first; then the awaiting task is cancelled, which aborts the requests (see
    ``OutputStream``)."""
    collect = asyncio.ensure_future(_all(stream))
    watch = asyncio.ensure_future(_client_leaves(request))
    done, _ = await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    if collect in done:
        watch.cancel()
        return collect.result()
    collect.cancel()
    await asyncio.gather(collect, return_exceptions=True)
    return None


async def _client_leaves(request: Request) -> None:
    """Returns when the server receives the client's disconnect (the body is read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _completion_chunks(
    stream: OutputStream,
    head: dict[str, Any],
    tokenizer: Any,
    include_usage: bool,
    n: int,
    echo: Callable[[int], tuple[str, list[int], int | None] | None],
) -> AsyncIterator[BaseModel]:
    """A chunk per output with text; a choice's first chunk starts with what it echoes."""
    offsets = [0] * len(stream.request_ids)
    last: dict[int, RequestOutput] = {}
    async for index, output in stream:
        echoed = echo(index) if index not in last else None
        last[index] = output
        if not (output.text or output.finished or output.logprobs or echoed):
            continue  # tokens whose text is held back (a possible stop string, a partial char)
        choice = completion_choice(index, output, tokenizer, offsets[index], echoed)
        offsets[index] += len(choice.text)
        yield Completion(**head, choices=[choice])
    if include_usage:
        finals = [last[index] for index in sorted(last)]
        yield Completion(**head, choices=[], usage=Usage.of(finals, n))


async def _chat_chunks(
    stream: OutputStream,
    head: dict[str, Any],
    tokenizer: Any,
    include_usage: bool,
    readers: list[ReplyReader],
) -> AsyncIterator[BaseModel]:
    """A chunk per output that tells something: reasoning, content, a call's piece,
    logprobs or the end; each choice's reader says what its text is."""
    for index in range(len(stream.request_ids)):
        first = ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))
        yield ChatCompletionChunk(**head, choices=[first])
    last: dict[int, RequestOutput] = {}
    async for index, output in stream:
        last[index] = output
        reader = readers[index]
        told = reader.take(output)
        if not (told.tells_anything() or output.finished or output.logprobs):
            continue
        delta = ChatDelta(
            content=told.content or None,
            tool_calls=list(told.calls) or None,
            reasoning_content=told.reasoning or None,
        )
        choice = ChatChunkChoice(
            index=index,
            delta=delta,
            logprobs=chat_logprobs(output, tokenizer),
            finish_reason=reader.finish_reason(output.finish_reason),
        )
        yield ChatCompletionChunk(**head, choices=[choice])
    if include_usage:
        finals = [last[index] for index in sorted(last)]
        yield ChatCompletionChunk(**head, choices=[], usage=Usage.of(finals, len(readers)))


def _event_stream(
    chunks: AsyncIterator[BaseModel | dict[str, Any]], named_events: bool = False
) -> StreamingResponse:
    """Server-sent events: ``data: {chunk}`` per chunk, then ``data: [DONE]``; with
    ``named_events`` (the Responses API's), ``event: {type}`` before each one's data and no
    ``[DONE]``. An engine failure mid-stream ends it with an error event (the status line is
    sent already)."""

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                if isinstance(chunk, dict):
                    yield f"event: {chunk['type']}\ndata: {json.dumps(chunk)}\n\n"
                else:
                    yield f"data: {chunk.model_dump_json()}\n\n"
        except Exception as exc:
            message = f"the engine failed: {exc}"
            if named_events:
                failure = {"type": "error", "code": "server_error", "message": message}
                yield f"event: error\ndata: {json.dumps(failure)}\n\n"
            else:
                yield f"data: {json.dumps(error_body(500, message))}\n\n"
        if not named_events:
            yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _add_plugin_routes(app: FastAPI, engine_loop: EngineLoop) -> None:
    """The ``POST`` routes of the enabled plugins (``nxdplug_serving_routes``): each handler
    runs between the engine's steps with the request's JSON object."""
    engine = engine_loop.engine
    neuron_config = engine.application.neuron_config
    for record in get_registry().records("serving_routes"):
        if record.is_enabled_by(neuron_config):
            app.add_api_route(
                record.path, _route(engine_loop, record.load("handler")), methods=["POST"]
            )


def _route(engine_loop: EngineLoop, handler: Any) -> Any:
    async def route(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError as exc:
            raise OpenAIError(400, f"malformed JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "the body must be a JSON object")
        try:
            result = await engine_loop.between_steps(lambda: handler(engine_loop.engine, body))
        except EngineStoppedError:
            raise
        except NxdPlugError as exc:
            raise OpenAIError(400, str(exc)) from None
        return JSONResponse(dict(result))

    return route


async def off_loop(work: Callable[..., T], *args: Any) -> T:
    """``work(*args)`` on a worker thread, so that a request's slow part (parsing a large body,
    a chat template, tokenizing a long prompt) never stalls the event loop, which streams every
    other client's tokens and answers ``/health``."""
    return await asyncio.to_thread(work, *args)


async def _parsed(request: Request, model: type[M]) -> M:
    """The request's JSON body as ``model``, parsed and checked off the event loop; a body
    that does not validate as FastAPI's own check would refuse it."""
    raw = await request.body()
    return await off_loop(_validated, model, raw)


def _validated(model: type[M], raw: bytes) -> M:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        raise RequestValidationError([e | {"loc": ("body", *e["loc"])} for e in errors]) from None


def _json(body: BaseModel) -> JSONResponse:
    return JSONResponse(body.model_dump(mode="json"))


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's body; a body that does not validate is a 400, as OpenAI's."""

    def answer(status: int, message: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(status, message, param=param), status_code=status)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> Response:
        error = exc.errors()[0]
        param = ".".join(str(part) for part in error["loc"] if part != "body") or None
        if error["type"] == "json_invalid":
            detail = error.get("ctx", {}).get("error", error["msg"])
            return answer(400, f"malformed JSON body: {detail}")
        if param is None:  # the body as a whole: not an object
            return answer(400, f"the body must be a JSON object: {error['msg']}")
        if error["type"] == "extra_forbidden":
            return answer(400, f"{param}: not supported by this server", param)
        return answer(400, f"{param}: {error['msg']}", param)

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> Response:
        return answer(400, str(exc), exc.field)

    @app.exception_handler(EngineFullError)
    @app.exception_handler(EngineStoppedError)
    async def unavailable(request: Request, exc: Exception) -> Response:
        return answer(503, str(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return answer(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> Response:
        return answer(500, f"{type(exc).__name__}: {exc}")
