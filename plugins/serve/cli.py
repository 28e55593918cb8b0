"""``nxdplug serve``: an OpenAI-compatible HTTP server over the engine.

The model is built as ``nxdplug run`` builds it, with continuous batching on (a KV-cache line
per request). The port is taken before the model loads, so a busy port fails at once. The main
thread, which loaded the model, steps the engine; uvicorn serves HTTP on a thread of its own.
On Ctrl-C or SIGTERM uvicorn stops taking connections and gives the requests in flight
:data:`GRACE_SECONDS` to finish; the engine loop then aborts whatever still runs, stops, and
the command exits 0. Under ``torchrun`` the first rank serves and the others follow its steps.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

from nxdplug.plugin_api import (
    NxdPlugError,
    add_compiled_model_options,
    add_extension_arguments,
    add_model_path,
    add_neuron_config_options,
    add_speculative_config_option,
    default_settings,
    engine_draft,
    inference_config,
    load_model,
    load_tokenizer,
    neuron_config_kwargs,
    positive_int,
    prepare_config,
    speculation_settings,
)
from nxdplug.plugins.serve.access import add_access_arguments, api_keys, cors_policy, tls_settings

LOG_LEVELS = ("debug", "info", "warning", "error")
GRACE_SECONDS = 5
# Serving defaults, below the options the user gives: a line per request, prompts encoded one
# at a time as they arrive, buckets (as NxD Inference's vLLM integration does): a short prompt
# or a young sequence does not pay for the longest one.
SERVE_DEFAULTS = {
    "is_continuous_batching": True,
    "batch_size": 8,
    "ctx_batch_size": 1,
    "enable_bucketing": True,
}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_path(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    server.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name requests give and /v1/models lists (default: --model-path as given)",
    )
    server.add_argument(
        "--max-waiting",
        type=positive_int,
        default=1024,
        metavar="N",
        help="requests queued beyond the running ones; more are answered 503",
    )
    server.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", help="info and debug log each request"
    )
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let chat requests leave the choice of calling tools to the model "
        "(tool_choice 'auto'); needs --tool-call-parser",
    )
    server.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        help="the format the model writes tool calls in: a tool-call parser plugin "
        "(hermes, llama3_json, mistral; `nxdplug plugins list` shows them)",
    )
    server.add_argument(
        "--reasoning-parser",
        metavar="NAME",
        help="answer the reasoning a model writes before its answer as reasoning_content: a "
        "reasoning parser plugin (qwen3, deepseek_r1)",
    )
    add_compiled_model_options(
        parser,
        required=False,
        without="the model is compiled into the cache (NXDPLUG_CACHE_DIR, else "
        "~/.cache/nxdplug) once per config and loaded from there",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run the model eagerly (to_cpu), compiling nothing (as vLLM's --enforce-eager)",
    )
    add_speculative_config_option(server)
    add_access_arguments(parser)
    add_neuron_config_options(parser)
    add_extension_arguments(parser, "serve")
    parser.epilog = (
        "Serving defaults (each overridable): --is-continuous-batching, --batch-size 8, "
        "--ctx-batch-size 1, --enable-bucketing, --enable-prefix-caching (where the config "
        "allows the block layout it needs); compiled into the cache once per config "
        "(--compiled-model-path DIR to choose the folder, --enforce-eager to compile nothing)."
    )


def run_serve(args: argparse.Namespace) -> int:
    _require_serving_packages()
    tool_parser = _tool_parser(args)
    reasoning_parser = _implementation("reasoning_parsers", args.reasoning_parser)
    access = (api_keys(args), cors_policy(args), tls_settings(args))
    sock = _listen(args.host, args.port) if os.environ.get("RANK", "0") == "0" else None
    settings = SERVE_DEFAULTS | neuron_config_kwargs(args) | speculation_settings(args)
    config = _serving_config(args, settings)
    prepare_config(args, config)
    model = load_model(args, config, compile_by_default=True)
    draft = engine_draft(args, config)  # on every rank that holds a shard of it
    tokenizer = load_tokenizer(args.model_path, "serve")
    others = {} if draft is None else {"draft": draft}

    from nxdplug.plugin_api import tp_rank, tp_world_size

    if tp_world_size() > 1 and tp_rank() != 0:
        from nxdplug.plugin_api import follow_steps

        with _on_stop_signals(signal.SIG_IGN):
            follow_steps(model, others)
        return 0
    assert sock is not None
    broadcaster = None
    if tp_world_size() > 1:
        from nxdplug.plugin_api import StepBroadcaster

        broadcaster = StepBroadcaster(model, others=others)
    try:
        parsers = (tool_parser, reasoning_parser)
        _serve(args, sock, (model, draft), tokenizer, broadcaster, parsers, access)
    finally:
        if broadcaster is not None:
            broadcaster.stop()
    return 0


def _serving_config(args: argparse.Namespace, settings: dict[str, Any]) -> Any:
    """The config of ``settings``, with what features turn on by default in a server (vLLM's
    prefix caching) where the options leave it unsaid and it keeps the config valid; where it
    would not, without it, saying why."""
    from nxdplug.plugin_api import config_problems

    defaults = {
        name: value
        for name, value in default_settings(args, "serve").items()
        if name not in settings
    }
    with_defaults = inference_config(args.model_path, defaults | settings)
    problems = config_problems(with_defaults) if defaults else []
    if not problems:
        return with_defaults
    config = inference_config(args.model_path, settings)
    known = set(config_problems(config))
    added = [p for p in problems if p not in known]
    if not added:
        return with_defaults
    if args.log_level in ("debug", "info"):
        names = ", ".join(f"{name}={value!r}" for name, value in defaults.items())
        print(f"nxdplug serve: not turning on {names} by default: {added[0]}", file=sys.stderr)
    return config


def _serve(
    args: argparse.Namespace,
    sock: socket.socket,
    models: tuple[Any, Any],
    tokenizer: Any,
    runner: Any,
    parsers: tuple[type | None, type | None],
    access: tuple[list[str], Any, dict[str, Any]],
) -> None:
    """Serve until stopped; ``models``: the target and the draft (None without one);
    ``parsers``: the tool-call and reasoning parsers, if any; ``access``: the API keys, the
    CORS policy and the TLS settings."""
    import uvicorn

    from nxdplug.plugin_api import Engine
    from nxdplug.plugins.serve.app import build_app
    from nxdplug.plugins.serve.engine_loop import EngineLoop
    from nxdplug.plugins.serve.guards import guarded
    from nxdplug.plugins.serve.metrics import ServingMetrics

    model, draft = models
    engine = Engine(
        model,
        tokenizer,
        max_waiting=args.max_waiting,
        runner=runner,
        speculative_config=args.speculative_config,
        draft_model=draft,
    )
    metrics = ServingMetrics(engine)
    engine_loop = EngineLoop(engine, metrics)
    name = args.served_model_name or str(args.model_path)
    keys, cors, tls = access
    app = guarded(
        build_app(engine_loop, tokenizer, name, metrics, *parsers),
        api_keys=keys,
        body_limit=args.max_request_body_size,
        cors=cors,
    )
    server_config = uvicorn.Config(
        app,
        root_path=args.root_path,
        **tls,
        log_level=args.log_level,
        access_log=args.log_level in ("debug", "info"),
        timeout_graceful_shutdown=GRACE_SECONDS,
    )
    if args.log_level != "debug":  # uvicorn's start-up lines; the one line below says it all
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    server = uvicorn.Server(server_config)

    http_failures: list[BaseException] = []

    def serve_http() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as failure:  # raised again on the main thread, below
            http_failures.append(failure)
        finally:
            engine_loop.stop()

    http = threading.Thread(target=serve_http, name="nxdplug-http")
    host, port = sock.getsockname()[:2]
    print(
        f"nxdplug: serving {name} at {'https' if tls else 'http'}://{_url_host(host)}:{port}/v1 "
        f"({model.backend_name} backend, batch size {model.neuron_config.max_batch_size})",
        flush=True,
    )
    with _on_stop_signals(server.handle_exit):
        http.start()
        try:
            engine_loop.run()
        finally:
            engine_loop.stop()
            if engine_loop.failure is not None:  # the requests have their error: stop too
                server.should_exit = True
            http.join()
    if http_failures:
        raise http_failures[0]
    if engine_loop.failure is not None:
        raise NxdPlugError(f"the engine failed, so the server stopped: {engine_loop.failure}")


def _tool_parser(args: argparse.Namespace) -> type | None:
    """The parser of ``--tool-call-parser``, which ``--enable-auto-tool-choice`` needs (and
    which does nothing without it): both or neither, as vLLM takes them."""
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise NxdPlugError(
            "--enable-auto-tool-choice and --tool-call-parser NAME go together: the parser "
            "finds the calls a model chooses to make; give both, or neither"
        )
    return _implementation("tool_parsers", args.tool_call_parser)


def _implementation(kind: str, name: str | None) -> type | None:
    """The class of the ``kind`` record called ``name`` (an unknown name lists the others)."""
    if name is None:
        return None
    from nxdplug.plugin_api import get_registry

    return get_registry().get(kind, name).load("implementation")


@contextlib.contextmanager
def _on_stop_signals(handler: Any) -> Iterator[None]:
    """Ctrl-C and SIGTERM go to ``handler`` inside the block. The first rank gives them to
    uvicorn, which serves on another thread where it cannot take signals (a first signal shuts
    down gracefully, a second Ctrl-C at once); a follower rank ignores them (a terminal or
    torchrun sends them to the whole process group): it stops when the first rank, shutting
    down, tells it to."""
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, previous_handler in previous.items():
            signal.signal(sig, previous_handler)


def _require_serving_packages() -> None:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise NxdPlugError(
            f"`nxdplug serve` needs {exc.name}, which is not installed: "
            "pip install 'nxdplug[serve]'"
        ) from exc


def _listen(host: str, port: int) -> socket.socket:
    """Take the port now, before the model loads, so that a busy port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise NxdPlugError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
