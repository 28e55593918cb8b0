"""What stands between the network and the routes: API keys and a limit on a request body's size.

Both are plain ASGI middleware, so that they answer before a route (or FastAPI's body parsing)
runs: a request without a valid key is a 401 whatever it sends, and a body over the limit is a
413 as soon as its declared length (or, for a chunked body, the bytes read so far) passes it,
never read whole.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import attrs
from starlette.exceptions import HTTPException

from nxdplug.plugins.serve.protocol import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The routes a load balancer or a monitoring system polls: open whatever the keys.
OPEN_PATHS = frozenset({"/health", "/metrics"})


async def _answer(send: Send, status: int, body: dict[str, Any], headers=()) -> None:
    content = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(content)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": content})


class RequireApiKey:
    """vLLM's ``--api-key``: every route but :data:`OPEN_PATHS` needs ``Authorization: Bearer
    KEY`` with one of ``keys``, compared in constant time (each key, whatever matches), else a
    401 with OpenAI's error body. CORS preflights (``OPTIONS``) pass, as browsers send them
    without credentials."""

    def __init__(self, app: ASGIApp, keys: Iterable[str]) -> None:
        self.app = app
        self.keys = [key.encode() for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] == "OPTIONS"
            or scope["path"].removeprefix(scope.get("root_path", "")) in OPEN_PATHS
            or self._authorized(scope)
        ):
            await self.app(scope, receive, send)
            return
        message = "missing or incorrect API key: send the header Authorization: Bearer KEY"
        body = error_body(401, message, code="invalid_api_key")
        await _answer(send, 401, body, [(b"www-authenticate", b"Bearer")])

    def _authorized(self, scope: Scope) -> bool:
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer":
            token = b""
        matches = [hmac.compare_digest(token.strip(), key) for key in self.keys]
        return any(matches)


class BodyTooLarge(HTTPException):
    """Raised into the app when a body without a declared length passes the limit as it is
    read: an HTTP error, so that the app's handlers answer it (a 413) like any other."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"the request body is larger than this server takes ({limit} bytes; nxdplug "
            "serve --max-request-body-size)",
        )


class LimitBodySize:
    """A 413 for a request whose body passes ``limit`` bytes: at once when its
    ``Content-Length`` says so, else as soon as the bytes read pass it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                refusal = BodyTooLarge(self.limit)
                await _answer(send, 413, error_body(413, refusal.detail))
                return
        read = 0

        async def limited_receive() -> Message:
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited_receive, send)


@attrs.frozen
class CorsPolicy:
    """Which browser origins may call the server (starlette's CORS middleware's settings)."""

    origins: tuple[str, ...]
    methods: tuple[str, ...] = ("GET", "POST")
    headers: tuple[str, ...] = ("Authorization", "Content-Type")
    credentials: bool = False


def guarded(
    app: ASGIApp, *, api_keys: Iterable[str], body_limit: int, cors: CorsPolicy | None
) -> ASGIApp:
    """``app`` behind the body limit, the API keys (if any) and CORS (if any), outermost
    last: a CORS preflight is answered before the keys are asked for."""
    from starlette.middleware.cors import CORSMiddleware

    guarded_app: ASGIApp = LimitBodySize(app, body_limit)
    keys = list(api_keys)
    if keys:
        guarded_app = RequireApiKey(guarded_app, keys)
    if cors is not None:
        guarded_app = CORSMiddleware(
            guarded_app,
            allow_origins=list(cors.origins),
            allow_methods=list(cors.methods),
            allow_headers=list(cors.headers),
            allow_credentials=cors.credentials,
        )
    return guarded_app
