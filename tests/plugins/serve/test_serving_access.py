"""``nxdplug serve`` on a network: API keys (vLLM's ``--api-key``), a limit on a body's size,
bodies parsed and prompts tokenized off the event loop, TLS, CORS, a proxy's root path, and
``GET /v1/models/{model}``; driven by the ``openai`` client and plain HTTP."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from tests.plugins.serve.test_serving import (  # noqa: E402
    MODEL,
    checkpoint,  # noqa: F401 (a fixture)
    running_server,
)

KEYS = ("key-one", "key-two")
ORIGIN = "http://app.example"
LIMIT = 2 * 1024 * 1024  # the default
RESET = "connection reset"


def call(url: str, body: bytes | None = None, headers: dict | None = None, method=None):
    """Status, headers and JSON (or text) body of one request, errors included."""
    sent = urllib.request.Request(url, data=body, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(sent, timeout=60) as reply:
            status, got, text = reply.status, dict(reply.headers), reply.read().decode()
    except urllib.error.HTTPError as error:
        status, got, text = error.code, dict(error.headers), error.read().decode()
    try:
        return status, got, json.loads(text)
    except json.JSONDecodeError:
        return status, got, text


def status_of(url: str, body: bytes, headers: dict) -> int | str:
    """The status of a POST, or RESET when the server closed the connection while the body
    was being sent (after answering 413 without reading it)."""
    try:
        return call(url, body, headers)[0]
    except (ConnectionError, urllib.error.URLError) as error:
        reason = getattr(error, "reason", error)
        assert isinstance(reason, ConnectionError), error
        return RESET


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(checkpoint) -> str:  # noqa: F811
    options = (
        "--seq-len", "1024", "--batch-size", "4", "--api-key", KEYS[0], "--api-key", KEYS[1],
        "--allowed-origins", json.dumps([ORIGIN]), "--root-path", "/api",
    )  # fmt: skip
    with running_server(checkpoint, *options) as base:
        yield base


def test_every_route_but_health_and_metrics_needs_a_key(server) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        client.models.list()
    assert refused.value.body["code"] == "invalid_api_key"
    for key in KEYS:
        client = openai.OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
    for path, body in [
        ("/v1/completions", b'{"model": "tiny-llama", "prompt": "a"}'),
        ("/tokenize", b'{"prompt": "a"}'),
        ("/v1/models", None),
    ]:
        status, headers, reply = call(f"{server}{path}", body, {"Authorization": "Bearer"})
        assert status == 401 and headers["www-authenticate"] == "Bearer", path
        assert reply["error"]["type"] == "AuthenticationError"
        status, *_ = call(f"{server}{path}", body, {"Authorization": f"Basic {KEYS[0]}"})
        assert status == 401
    assert call(f"{server}/health")[0] == 200
    assert call(f"{server}/metrics")[0] == 200
    # behind a proxy that strips the root path, OpenAPI clients are told where it is
    assert call(f"{server}/openapi.json", headers=bearer(KEYS[0]))[2]["servers"] == [
        {"url": "/api"}
    ]


def test_a_model_card_by_name(server) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEYS[0], max_retries=0)
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError, match="`tiny-llama`"):
        client.models.retrieve("gpt-4")


def test_cors_lets_only_the_allowed_origin_in(server) -> None:
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "Authorization, Content-Type",
    }
    status, headers, _ = call(f"{server}/v1/completions", headers=preflight, method="OPTIONS")
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    other = preflight | {"Origin": "http://evil.example"}
    status, headers, _ = call(f"{server}/v1/completions", headers=other, method="OPTIONS")
    assert status == 400 and "access-control-allow-origin" not in headers
    status, headers, _ = call(f"{server}/v1/models", headers=bearer(KEYS[0]) | {"Origin": ORIGIN})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN


def test_a_body_over_the_limit_is_refused_before_it_is_read(server) -> None:
    # a declared length over the limit: answered from the headers, the body never sent
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
            f"{KEYS[0]}\r\nContent-Type: application/json\r\nContent-Length: {LIMIT + 1}"
            "\r\n\r\n".encode()
        )
        answer = b""
        while b"max-request-body-size" not in answer and (part := sock.recv(65536)):
            answer += part
    assert answer.startswith(b"HTTP/1.1 413 ") and b"--max-request-body-size" in answer
    # without a length up front (chunked), refused once the bytes read pass the limit
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    chunks = (b"x" * 65536 for _ in range(LIMIT // 65536 + 2))
    connection.request(
        "POST", "/v1/completions", body=chunks, headers=bearer(KEYS[0]), encode_chunked=True
    )
    reply = connection.getresponse()
    assert reply.status == 413 and b"max-request-body-size" in reply.read()
    connection.close()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[1, 2]", "the body must be a JSON object"),
        (b"model=tiny-llama&prompt=a", "malformed JSON body"),
    ],
)
def test_a_body_that_is_no_object_says_so(server, body, message) -> None:
    status, _, reply = call(f"{server}/v1/chat/completions", body, bearer(KEYS[0]))
    assert status == 400 and reply["error"]["message"].startswith(message)


def test_heavy_bodies_stall_no_other_client(server) -> None:
    """While a stream runs, bodies that are slow to parse or tokenize (a 10 MB prompt, 100k
    messages, deep nesting, a huge logit_bias, a prompt of ~400k tokens just under the limit)
    are answered with errors, and the stream's chunks and /health keep coming within 0.5 s."""
    key = bearer(KEYS[0])
    words = "alpha beta gamma delta " * (LIMIT // 24 - 100)
    heavy = [
        ({"model": MODEL, "prompt": "x " * 5_000_000}, "/v1/completions", 413),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 100_000},
            "/v1/chat/completions",
            413,
        ),
        (f'{{"model": "m", "prompt": {"[" * 100_000}{"]" * 100_000}}}', "/v1/completions", 400),
        (
            {"model": MODEL, "prompt": "a", "logit_bias": {str(i): 1 for i in range(80_000)}},
            "/v1/completions",
            400,
        ),
        ({"model": MODEL, "prompt": words}, "/v1/completions", 400),
    ]  # fmt: skip
    # made before the stream starts: json.dumps in this process would stall its reading
    bodies = [((b if isinstance(b, str) else json.dumps(b)).encode(), path) for b, path, _ in heavy]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEYS[0], max_retries=0, timeout=60)
    stream = client.completions.create(
        model=MODEL, prompt="a b", max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
    )
    done = threading.Event()
    statuses, health_waits = [], []

    def send_heavy() -> None:
        try:
            for data, path in bodies:
                statuses.append(status_of(f"{server}{path}", data, key))
        finally:
            done.set()

    def poll_health() -> None:
        while not done.is_set():
            start = time.perf_counter()
            call(f"{server}/health")
            health_waits.append(time.perf_counter() - start)
            time.sleep(0.05)

    chunks = iter(stream)
    next(chunks)
    senders = [threading.Thread(target=send_heavy), threading.Thread(target=poll_health)]
    for thread in senders:
        thread.start()
    gaps, last = [], time.perf_counter()
    for _ in chunks:
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        if done.is_set():
            break
    stream.close()
    for thread in senders:
        thread.join()
    # a client that sends a body the server refused unread may see the connection reset
    assert [413 if s == RESET else s for s in statuses] == [status for _, _, status in heavy]
    assert done.is_set(), "the stream ended before the heavy requests did"
    assert max(gaps) < 0.5 and max(health_waits) < 0.5, (max(gaps), max(health_waits))


def test_https_with_a_self_signed_certificate(checkpoint, tmp_path) -> None:  # noqa: F811
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command makes the test's certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    tls = ("--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--seq-len", "64")
    with running_server(checkpoint, *tls) as base:
        assert base.startswith("https://")
        trusted = ssl.create_default_context(cafile=str(cert))
        body = json.dumps({"model": MODEL, "prompt": "a b", "max_tokens": 3}).encode()
        sent = urllib.request.Request(
            f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(sent, timeout=60, context=trusted) as reply:
            assert json.loads(reply.read())["usage"]["completion_tokens"] == 3
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(f"{base}/health", timeout=60)  # not trusted by default
        plain_http_fails = (urllib.error.URLError, http.client.HTTPException, ConnectionError)
        with pytest.raises(plain_http_fails):  # plain HTTP is not served
            urllib.request.urlopen(base.replace("https://", "http://") + "/health", timeout=60)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--ssl-keyfile", "k.pem"], "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
        (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"], "cannot be loaded"),
        (["--allowed-methods", "GET"], "--allowed-methods shapes CORS, which is off"),
        (["--allowed-origins", "[1]"], "expected a JSON list of strings"),
        (["--api-key", " "], "a key cannot be empty"),
    ],
)
def test_bad_access_options_fail_before_the_model_loads(
    checkpoint,  # noqa: F811
    tmp_path,
    capsys,
    options,
    message,
) -> None:
    from nxdplug.cli.main import main

    options = [str(tmp_path / o) if o.endswith(".pem") else o for o in options]
    argv = ["serve", "--model-path", str(checkpoint), "--port", "0", *options]
    assert main(argv) in (1, 2)
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error
