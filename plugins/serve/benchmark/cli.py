"""``nxdplug benchmark-serving``: throughput and latency of an OpenAI-compatible server under
concurrent streamed requests, as vLLM's ``benchmark_serving.py`` measures them.

Without ``--base-url`` it starts ``nxdplug serve`` on a free local port, sends warm-up
requests, runs the load and stops the server; each ``--compare-server-options`` starts one more
``nxdplug serve`` with those options added, and ``--compare-transformers-serve`` HF
``transformers serve --continuous-batching`` on the same checkpoint and dtype (one server at a
time); the report gives the first nxdplug server's ratio to each of the others. ``--runs N``
does all of that N times, the servers in turn, and reports each metric's median (the ratios:
the median of each run's ratio): on a shared machine one run of each can catch different loads.

``--workload`` picks the load: ``random`` (:mod:`nxdplug.plugins.serve.benchmark.load`), or
``multi-turn`` and ``long-prompt`` (:mod:`nxdplug.plugins.serve.benchmark.workloads`), the
cases of prefix caching and chunked prefill. The texts are made once, the same for every
server and run. An nxdplug server's own ``/metrics`` add its peak of running requests and its
prefix-cache hit rate (:mod:`nxdplug.plugins.serve.benchmark.server_metrics`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import shutil
import statistics
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import attrs

from nxdplug.plugin_api import (
    NxdPlugError,
    add_neuron_config_options,
    neuron_config_kwargs,
    positive_int,
)

HOST = "127.0.0.1"
# The command line of this Python's nxdplug (the nxdplug script may not be on PATH).
NXDPLUG_COMMAND = ("-m", "nxdplug.cli.main")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1"}
# transformers serve rejects fields it does not know (ignore_eos among them) but takes a whole
# generation config; an eos id of -1 matches no token.
TRANSFORMERS_NO_EOS = {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})}
NXDPLUG_NO_EOS = {"ignore_eos": True}
WORKLOADS = ("random", "multi-turn", "long-prompt")
# A workload's flags and their defaults: another workload's flag is refused unless left at its
# default, rather than silently ignored.
WORKLOAD_FLAGS = {
    "--concurrency": ("random", 16),
    "--num-requests": ("random", 64),
    "--prompt-file": ("random", None),
    "--conversations": ("multi-turn", 8),
    "--turns": ("multi-turn", 4),
    "--system-prompt-length": ("multi-turn", 1024),
    "--streams": ("long-prompt", 8),
    "--long-prompt-length": ("long-prompt", 2000),
    "--long-prompt-after": ("long-prompt", 16),
}
# Offsets from --seed of each kind of synthetic text, so that no two kinds share tokens: a
# warm-up prompt the timed load repeated would be found in a prefix cache.
MAIN_SEED, SECOND_SEED, WARMUP_SEED, SECOND_WARMUP_SEED = range(4)
# (label, key in the figures, format); a row no server has is left out, a missing cell is "-".
SERVER_ROWS = (
    ("peak running requests", "peak_running_requests", "{:.0f}"),
    ("server prefix-cache hit rate", "server_prefix_cache_hit_rate", "{:.3f}"),
    ("speculation acceptance rate", "spec_acceptance_rate", "{:.3f}"),
    ("tokens per verification", "spec_tokens_per_verification", "{:.2f}"),
)
TABLE_ROWS = {
    "random": (
        ("output tok/s", "output_tokens_per_s", "{:.1f}"),
        ("requests/s", "requests_per_s", "{:.2f}"),
        ("TTFT p50 (ms)", "ttft_p50_ms", "{:.1f}"),
        ("TTFT p99 (ms)", "ttft_p99_ms", "{:.1f}"),
        ("ITL p50 (ms)", "itl_p50_ms", "{:.1f}"),
        ("ITL p99 (ms)", "itl_p99_ms", "{:.1f}"),
        ("TPOT p50 (ms)", "tpot_p50_ms", "{:.1f}"),
        ("end-to-end p50 (ms)", "e2e_p50_ms", "{:.0f}"),
        ("output tokens", "output_tokens", "{:.0f}"),
        ("streamed chunks", "chunks", "{:.0f}"),
        ("duration (s)", "duration_s", "{:.1f}"),
    ),
    "multi-turn": (
        ("output tok/s", "output_tokens_per_s", "{:.1f}"),
        ("TTFT turn 1 p50 (ms)", "ttft_first_turn_p50_ms", "{:.1f}"),
        ("TTFT turn 1 p99 (ms)", "ttft_first_turn_p99_ms", "{:.1f}"),
        ("TTFT turns 2+ p50 (ms)", "ttft_later_turns_p50_ms", "{:.1f}"),
        ("TTFT turns 2+ p99 (ms)", "ttft_later_turns_p99_ms", "{:.1f}"),
        ("ITL p50 (ms)", "itl_p50_ms", "{:.1f}"),
        ("ITL p99 (ms)", "itl_p99_ms", "{:.1f}"),
        ("prefix-cache hit rate", "prefix_cache_hit_rate", "{:.3f}"),
        ("prompt tokens", "prompt_tokens", "{:.0f}"),
        ("output tokens", "output_tokens", "{:.0f}"),
        ("duration (s)", "duration_s", "{:.1f}"),
    ),
    "long-prompt": (
        ("output tok/s", "output_tokens_per_s", "{:.1f}"),
        ("streams' ITL p50 (ms)", "itl_p50_ms", "{:.1f}"),
        ("streams' ITL p99 (ms)", "itl_p99_ms", "{:.1f}"),
        ("streams' ITL p99 / p50", "itl_p99_over_p50", "{:.2f}"),
        ("streams' ITL max (ms)", "itl_max_ms", "{:.1f}"),
        ("long prompt TTFT (ms)", "long_prompt_ttft_ms", "{:.1f}"),
        ("long prompt tokens", "long_prompt_tokens", "{:.0f}"),
        ("streams' TTFT p50 (ms)", "ttft_p50_ms", "{:.1f}"),
        ("output tokens", "output_tokens", "{:.0f}"),
        ("duration (s)", "duration_s", "{:.1f}"),
    ),
}
# The ratios of the closing lines, per workload: (label, key).
SUMMARY_RATIOS = {
    "random": (
        ("output tok/s", "output_tokens_per_s"),
        ("TTFT p99", "ttft_p99_ms"),
        ("ITL p50", "itl_p50_ms"),
    ),
    "multi-turn": (
        ("output tok/s", "output_tokens_per_s"),
        ("TTFT turn 1 p50", "ttft_first_turn_p50_ms"),
        ("TTFT turns 2+ p50", "ttft_later_turns_p50_ms"),
    ),
    "long-prompt": (
        ("output tok/s", "output_tokens_per_s"),
        ("streams' ITL p99", "itl_p99_ms"),
        ("long prompt TTFT", "long_prompt_ttft_ms"),
    ),
}


def add_benchmark_serving_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-path",
        required=True,
        type=Path,
        metavar="DIR",
        help="the HF checkpoint folder served (its tokenizer makes the synthetic prompts)",
    )
    parser.add_argument(
        "--compiled-model-path",
        type=Path,
        metavar="DIR",
        help="passed to `nxdplug serve`: compile into DIR (reused when it matches) and load "
        "from it; without it the server compiles into its cache (see `nxdplug serve --help`)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="passed to `nxdplug serve`: run the model eagerly, compiling nothing",
    )
    parser.add_argument(
        "--compiler-args",
        metavar="ARGS",
        help='passed to `nxdplug serve`, e.g. "freezing=true max_autotune=true" for inductor',
    )
    parser.add_argument(
        "--serve-options",
        metavar="OPTIONS",
        help="more `nxdplug serve` options for every nxdplug server this command starts, as "
        'one string: --serve-options="--enable-prefix-caching --block-size 16" ("=" since the '
        'value starts with "-"; NeuronConfig options such as --seq-len are this command\'s own '
        "and passed on)",
    )
    parser.add_argument(
        "--base-url",
        metavar="URL",
        help="load an already running server (e.g. http://127.0.0.1:8000/v1) instead of "
        "starting `nxdplug serve`; requests ask it to ignore end-of-sequence (ignore_eos)",
    )
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="with --base-url: the model name requests give (default: the first of /v1/models)",
    )
    load = parser.add_argument_group("load")
    load.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="random",
        help="random: --concurrency clients send --num-requests prompts; multi-turn: "
        "conversations whose turns resend the conversation so far (prefix caching); "
        "long-prompt: one long prompt sent while streams decode (chunked prefill)",
    )
    _workload_flag(
        load, "--concurrency", "clients, each sending its next request when its last ends"
    )
    _workload_flag(load, "--num-requests", "requests in all")
    load.add_argument(
        "--warmup-requests",
        type=positive_int,
        metavar="N",
        help="untimed requests sent to each server first, as many at a time as the workload's "
        "clients (default: that many: transformers serve's first wave of concurrent requests "
        "pays a one-time cost of seconds); other prompts than the timed load's",
    )
    load.add_argument(
        "--prompt-length",
        type=positive_int,
        default=64,
        metavar="N",
        help="tokens of each random prompt, multi-turn user part, long-prompt stream's prompt",
    )
    load.add_argument(
        "--max-tokens",
        type=positive_int,
        default=64,
        metavar="N",
        help="new tokens per request or turn (end-of-sequence is ignored, so exactly N)",
    )
    load.add_argument(
        "--prompt-file",
        type=Path,
        default=WORKLOAD_FLAGS["--prompt-file"][1],
        metavar="FILE",
        help="prompts, one per line, or JSON lines with a prompt (or text) field each, used "
        "in turn (--workload random); default: --prompt-length random token ids decoded with "
        "the model's tokenizer",
    )
    load.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    load.add_argument(
        "--runs",
        type=positive_int,
        default=1,
        metavar="N",
        help="measure N times, the servers in turn (each started, warmed up, loaded and "
        "stopped in each run), and report the medians",
    )
    turns = parser.add_argument_group("multi-turn workload")
    _workload_flag(turns, "--conversations", "conversations at once, a client each")
    _workload_flag(turns, "--turns", "requests of each conversation, one after another")
    _workload_flag(
        turns, "--system-prompt-length", "tokens of the system text every conversation starts with"
    )
    long = parser.add_argument_group("long-prompt workload")
    _workload_flag(long, "--streams", "streams of --max-tokens decoding together")
    _workload_flag(long, "--long-prompt-length", "tokens of the long prompt")
    _workload_flag(
        long, "--long-prompt-after", "tokens every stream has streamed when the long prompt is sent"
    )
    parser.add_argument(
        "--compare-server-options",
        action="append",
        default=[],
        metavar="OPTIONS",
        help="then one more `nxdplug serve` with these options added, as one string: "
        "--compare-server-options=--no-enable-prefix-caching (repeatable; each labelled "
        "`nxdplug OPTIONS` and compared with the first nxdplug server)",
    )
    parser.add_argument(
        "--compare-transformers-serve",
        action="store_true",
        help="then run the same load on `transformers serve --continuous-batching` with the "
        "same checkpoint and dtype, and print the ratios",
    )
    parser.add_argument(
        "--start-timeout",
        type=positive_int,
        default=900,
        metavar="S",
        help="seconds a server may take to load (and compile) before /health answers",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    add_neuron_config_options(parser)
    parser.epilog = (
        "The server's --batch-size defaults to the workload's clients (a cache line each): "
        "--concurrency, --conversations, or --streams plus the long request."
    )


def _workload_flag(group: argparse._ArgumentGroup, flag: str, help_text: str) -> None:
    workload, default = WORKLOAD_FLAGS[flag]
    help_text = f"{help_text} (--workload {workload}; default {default})"
    group.add_argument(flag, type=positive_int, default=default, metavar="N", help=help_text)


@attrs.frozen
class ServerUnderTest:
    """A server to benchmark: how to start it, what to name in requests, what to add to them."""

    label: str
    command: list[str]
    model: str
    extra_body: dict[str, Any]


@attrs.frozen
class Workload:
    """The load of ``--workload``, its texts made once: ``warm_up`` and ``run`` take a server's
    base URL, model name and extra body; ``run`` gives its figures."""

    warmup_description: str
    warm_up: Callable[[str, str, dict[str, Any]], None]
    description: str
    run: Callable[[str, str, dict[str, Any]], dict[str, float]]


def run_benchmark_serving(args: argparse.Namespace) -> int:
    def progress(message: str) -> None:
        if not args.quiet:
            print(f"benchmark-serving: {message}", file=sys.stderr, flush=True)

    from nxdplug.plugins.serve.benchmark.load import require_client_packages

    check_arguments(args)
    require_client_packages()
    workload = _workload(args)
    runs: list[dict[str, dict[str, float]]] = []
    for run in range(1, args.runs + 1):
        if args.runs > 1:
            progress(f"run {run} of {args.runs}")
        results: dict[str, dict[str, float]] = {}
        # closing(): an error in a load stops the server running at the time.
        with contextlib.closing(_servers(args, progress)) as servers:
            for label, base_url, model, extra_body in servers:
                results[label] = _measure(workload, label, base_url, model, extra_body, progress)
        runs.append(results)
    report = build_report(args, runs)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse what the flags cannot mean together, before a server starts."""
    for flag, (workload, default) in WORKLOAD_FLAGS.items():
        if args.workload != workload and getattr(args, _dest(flag)) != default:
            raise NxdPlugError(f"{flag} applies to --workload {workload}, not {args.workload}")
    if args.workload == "long-prompt" and args.long_prompt_after >= args.max_tokens:
        raise NxdPlugError(
            f"--long-prompt-after {args.long_prompt_after} must be below --max-tokens "
            f"{args.max_tokens}: the streams must still run when the long prompt is sent"
        )
    if args.base_url is not None:
        if (
            args.compare_transformers_serve
            or args.compare_server_options
            or args.serve_options
            or args.compiled_model_path
            or args.enforce_eager
        ):
            raise NxdPlugError(
                "--base-url loads a running server: --compare-transformers-serve, "
                "--compare-server-options, --serve-options, --compiled-model-path and "
                "--enforce-eager apply to the servers this command starts; leave them out"
            )
        return
    servers = [nxdplug_server(args), *_compared_servers(args)]
    labels = [server.label for server in servers]
    for server in servers:
        if labels.count(server.label) > 1:
            raise NxdPlugError(f"--compare-server-options gives {server.label!r} twice")
        _check_serve_command(server)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _split_options(text: str, flag: str = "--compare-server-options") -> list[str]:
    try:
        options = shlex.split(text)
    except ValueError as exc:
        raise NxdPlugError(f"{flag} {text!r}: {exc}") from None
    if not options:
        raise NxdPlugError(f"{flag} {text!r} names no option")
    return options


class _RefusingParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise NxdPlugError(message)


def _check_serve_command(server: ServerUnderTest) -> None:
    """Parse a server's command line as `nxdplug serve` will, so that an option it refuses
    fails now rather than after the servers before it have run."""
    from nxdplug.plugins.serve.cli import add_serve_arguments

    parser = _RefusingParser(prog="nxdplug serve", add_help=False)
    add_serve_arguments(parser)
    serve_argv = server.command[len(NXDPLUG_COMMAND) + 2 :]
    try:
        neuron_config_kwargs(parser.parse_args(serve_argv))
    except NxdPlugError as exc:
        raise NxdPlugError(
            f"`nxdplug serve` would refuse the options of server {server.label!r} "
            f"(--serve-options, --compare-server-options; NeuronConfig options such as "
            f"--seq-len belong to benchmark-serving itself): {exc}"
        ) from None


def clients(args: argparse.Namespace) -> int:
    """The requests the workload runs at once: the server's default batch size."""
    if args.workload == "multi-turn":
        return args.conversations
    if args.workload == "long-prompt":
        return args.streams + 1
    return args.concurrency


def _measure(
    workload: Workload,
    label: str,
    base_url: str,
    model: str,
    extra_body: dict[str, Any],
    progress: Callable[[str], None],
) -> dict[str, float]:
    """Untimed warm-up requests, then the timed load, with what the server's /metrics say of
    it."""
    from nxdplug.plugins.serve.benchmark.server_metrics import (
        metrics_url,
        polled_running_requests,
        scrape,
        server_figures,
    )

    progress(f"{label}: {workload.warmup_description}")
    try:
        workload.warm_up(base_url, model, extra_body)
    except NxdPlugError as exc:
        raise NxdPlugError(f"{label}, warm-up: {exc}") from exc
    progress(f"{label}: {workload.description}")
    url = metrics_url(base_url)
    before = scrape(url) or {}
    try:
        with polled_running_requests(url) as running:
            figures = workload.run(base_url, model, extra_body)
    except NxdPlugError as exc:
        raise NxdPlugError(f"{label}: {exc}") from exc
    return figures | server_figures(before, scrape(url) or {}, running)


def _workload(args: argparse.Namespace) -> Workload:
    """The texts of ``--workload`` made with the model's tokenizer, and how to send them."""
    from transformers import AutoConfig

    from nxdplug.plugin_api import load_tokenizer

    tokenizer = load_tokenizer(args.model_path, "benchmark-serving")
    vocab_size = AutoConfig.from_pretrained(str(args.model_path)).get_text_config().vocab_size
    if len(tokenizer) < vocab_size:
        warnings.warn(
            f"the tokenizer has {len(tokenizer)} tokens and the model {vocab_size}: generated "
            "ids beyond the tokenizer stream no text, so TTFT and ITL are timed on the tokens "
            "that have some (random-weight checkpoints pick those ids often)",
            stacklevel=2,
        )
    build = {
        "random": _random_workload,
        "multi-turn": _multi_turn_workload,
        "long-prompt": _long_prompt_workload,
    }
    return build[args.workload](args, tokenizer)


def _texts(
    args: argparse.Namespace, tokenizer: Any, count: int, length: int, seed: int
) -> list[str]:
    from nxdplug.plugins.serve.benchmark.load import synthetic_prompts

    return synthetic_prompts(tokenizer, count, length, args.seed + seed)


def _warm_up(
    args: argparse.Namespace, tokenizer: Any, length: int
) -> tuple[str, Callable[[str, str, dict[str, Any]], None]]:
    """The warm-up's description and function: ``--warmup-requests`` prompts of ``length``
    tokens (the workload's clients by default), that many at a time."""
    from nxdplug.plugins.serve.benchmark.load import send_requests

    at_once = clients(args)
    count = args.warmup_requests or at_once
    prompts = _texts(args, tokenizer, count, length, WARMUP_SEED)

    def warm_up(base_url: str, model: str, extra_body: dict[str, Any]) -> None:
        send_requests(base_url, model, prompts, args.max_tokens, at_once, count, extra_body)

    return f"{count} warm-up request(s)", warm_up


def _random_workload(args: argparse.Namespace, tokenizer: Any) -> Workload:
    from nxdplug.plugins.serve.benchmark.load import read_prompt_file, run_serving_load

    if args.prompt_file is not None:
        prompts = read_prompt_file(args.prompt_file)
    else:
        prompts = _texts(args, tokenizer, args.num_requests, args.prompt_length, MAIN_SEED)

    def run(base_url: str, model: str, extra_body: dict[str, Any]) -> dict[str, float]:
        return run_serving_load(
            base_url,
            model,
            prompts,
            args.max_tokens,
            args.concurrency,
            args.num_requests,
            extra_body,
        ).to_dict()

    description = (
        f"{args.num_requests} requests, {args.concurrency} at a time, {args.max_tokens} tokens each"
    )
    return Workload(*_warm_up(args, tokenizer, args.prompt_length), description, run)


def _multi_turn_workload(args: argparse.Namespace, tokenizer: Any) -> Workload:
    from nxdplug.plugins.serve.benchmark.workloads import run_multi_turn_load

    system = _texts(args, tokenizer, 1, args.system_prompt_length, MAIN_SEED)[0]
    parts = _texts(
        args, tokenizer, args.conversations * args.turns, args.prompt_length, SECOND_SEED
    )
    users = [parts[c * args.turns : (c + 1) * args.turns] for c in range(args.conversations)]

    def run(base_url: str, model: str, extra_body: dict[str, Any]) -> dict[str, float]:
        return run_multi_turn_load(
            base_url, model, system, users, args.max_tokens, extra_body
        ).to_dict()

    last = args.system_prompt_length + args.turns * args.prompt_length
    last += (args.turns - 1) * args.max_tokens
    description = (
        f"{args.conversations} conversations of {args.turns} turns, {args.max_tokens} tokens "
        f"each (the last turns' prompts: about {last} tokens)"
    )
    # The warm-up's prompts are as long as a first turn's.
    length = args.system_prompt_length + args.prompt_length
    return Workload(*_warm_up(args, tokenizer, length), description, run)


def _long_prompt_workload(args: argparse.Namespace, tokenizer: Any) -> Workload:
    from nxdplug.plugins.serve.benchmark.load import send_requests
    from nxdplug.plugins.serve.benchmark.workloads import (
        LONG_PROMPT_NEW_TOKENS,
        run_long_prompt_load,
    )

    prompts = _texts(args, tokenizer, args.streams, args.prompt_length, MAIN_SEED)
    long_prompt = _texts(args, tokenizer, 1, args.long_prompt_length, SECOND_SEED)[0]
    # A long prompt in the warm-up too: its length's first encoding may pay one-time costs.
    warm_long = _texts(args, tokenizer, 1, args.long_prompt_length, SECOND_WARMUP_SEED)
    warmup_description, warm_streams = _warm_up(args, tokenizer, args.prompt_length)

    def warm_up(base_url: str, model: str, extra_body: dict[str, Any]) -> None:
        warm_streams(base_url, model, extra_body)
        try:
            send_requests(base_url, model, warm_long, LONG_PROMPT_NEW_TOKENS, 1, 1, extra_body)
        except NxdPlugError as exc:
            raise NxdPlugError(f"the long prompt (--long-prompt-length): {exc}") from exc

    def run(base_url: str, model: str, extra_body: dict[str, Any]) -> dict[str, float]:
        return run_long_prompt_load(
            base_url,
            model,
            prompts,
            args.max_tokens,
            long_prompt,
            args.long_prompt_after,
            extra_body,
        ).to_dict()

    description = (
        f"{args.streams} streams of {args.max_tokens} tokens, then after "
        f"{args.long_prompt_after} tokens each a {args.long_prompt_length}-token prompt"
    )
    return Workload(f"{warmup_description} and a long prompt", warm_up, description, run)


def _servers(
    args: argparse.Namespace, progress: Callable[[str], None]
) -> Iterator[tuple[str, str, str, dict[str, Any]]]:
    """``(label, base_url, model name, extra body)`` of each server in turn, each running
    while the caller loads it (and stopped when the caller asks for the next)."""
    from nxdplug.plugins.serve.benchmark.server_process import free_port, running_server

    if args.base_url is not None:
        base_url = args.base_url.rstrip("/")
        model = args.served_model_name or _first_model(base_url)
        yield "server", base_url, model, dict(NXDPLUG_NO_EOS)
        return
    servers = [nxdplug_server(args), *_compared_servers(args)]
    if args.compare_transformers_serve:
        servers.append(_transformers_server(args))
    for server in servers:
        port = free_port(HOST)
        command = [*server.command, "--host", HOST, "--port", str(port)]
        progress(f"starting {server.label}: {' '.join(command)}")
        with running_server(
            command, f"http://{HOST}:{port}/health", args.start_timeout, OFFLINE_ENV
        ):
            yield server.label, f"http://{HOST}:{port}/v1", server.model, server.extra_body
        progress(f"stopped {server.label}")


def server_options(args: argparse.Namespace) -> dict[str, Any]:
    """The NeuronConfig options passed to ``nxdplug serve``: the user's, with a batch (a
    KV-cache line) per request the workload runs at once by default."""
    return {"batch_size": clients(args)} | neuron_config_kwargs(args)


def nxdplug_server(args: argparse.Namespace, extra: Sequence[str] = ()) -> ServerUnderTest:
    """The `nxdplug serve` command this benchmark starts, with the user's model options and
    ``--serve-options``, then ``extra`` (a compared server's: they win over the others)."""
    model = str(args.model_path)
    command = [sys.executable, *NXDPLUG_COMMAND, "serve", "--model-path", model]
    command += ["--served-model-name", model, "--log-level", "warning"]
    if args.compiled_model_path is not None:
        command += ["--compiled-model-path", str(args.compiled_model_path)]
    if args.compiler_args is not None:
        command += ["--compiler-args", args.compiler_args]
    if args.enforce_eager:
        command.append("--enforce-eager")
    for key, value in server_options(args).items():
        command += ["--neuron-config", f"{key}={json.dumps(value)}"]
    if args.serve_options is not None:
        command += _split_options(args.serve_options, "--serve-options")
    label = " ".join(["nxdplug", shlex.join(extra)]) if extra else "nxdplug"
    return ServerUnderTest(label, [*command, *extra], model, dict(NXDPLUG_NO_EOS))


def _compared_servers(args: argparse.Namespace) -> list[ServerUnderTest]:
    return [nxdplug_server(args, _split_options(text)) for text in args.compare_server_options]


def _transformers_server(args: argparse.Namespace) -> ServerUnderTest:
    from nxdplug.plugin_api import inference_config

    beside = Path(sys.executable).parent / "transformers"
    executable = str(beside) if beside.exists() else shutil.which("transformers")
    if executable is None:
        raise NxdPlugError(
            "--compare-transformers-serve needs the `transformers` command (pip install "
            "'transformers[serving]'); it is neither beside this Python nor on PATH"
        )
    config = inference_config(args.model_path, server_options(args))
    dtype = str(config.neuron_config.torch_dtype).removeprefix("torch.")
    model = str(args.model_path)
    command = [executable, "serve", model, "--continuous-batching", "--dtype", dtype]
    command += ["--device", "cpu", "--log-level", "warning"]
    return ServerUnderTest("transformers", command, model, dict(TRANSFORMERS_NO_EOS))


def _first_model(base_url: str) -> str:
    import openai

    try:
        models = openai.OpenAI(base_url=base_url, api_key="unused").models.list().data
    except openai.OpenAIError as exc:
        raise NxdPlugError(f"GET {base_url}/models failed: {exc}") from exc
    if not models:
        raise NxdPlugError(f"{base_url}/models lists no model; give --served-model-name")
    return models[0].id


def build_report(
    args: argparse.Namespace, runs: list[dict[str, dict[str, float]]]
) -> dict[str, Any]:
    """The medians over runs of each server's figures and of each run's ratios (a run's figures
    alone for one run); with several runs, each run's figures too."""
    runs = [run | _ratios(run) for run in runs]
    report: dict[str, Any] = {
        "config": _config(args, len(runs)),
        **{label: _medians([run[label] for run in runs]) for label in runs[0] if label != "ratios"},
    }
    if "ratios" in runs[0]:
        report["ratios"] = {
            label: _medians([run["ratios"][label] for run in runs]) for label in runs[0]["ratios"]
        }
    if len(runs) > 1:
        report["runs"] = runs
    return report


def _medians(figures: list[dict[str, float]]) -> dict[str, float]:
    """Each key's median over the runs that have it."""
    keys = dict.fromkeys(key for run in figures for key in run)
    return {key: statistics.median(run[key] for run in figures if key in run) for key in keys}


def _ratios(run: dict[str, dict[str, float]]) -> dict[str, dict[str, dict[str, float]]]:
    """``{"ratios": {label: nxdplug / that server for each figure}}`` for every server after
    the first nxdplug one, when there is one; figures a server lacks or has at 0 get none."""
    if "nxdplug" not in run or len(run) < 2:
        return {}
    ours = run["nxdplug"]
    return {
        "ratios": {
            label: {key: ours[key] / theirs[key] for key in ours if theirs.get(key)}
            for label, theirs in run.items()
            if label != "nxdplug"
        }
    }


def _config(args: argparse.Namespace, runs: int) -> dict[str, Any]:
    """The settings of the run: the workload's own flags, and the servers' options."""
    config = {
        "model": str(args.model_path),
        "compiled_model_path": str(args.compiled_model_path or ""),
        "workload": args.workload,
        "prompt_length": args.prompt_length,
        "max_tokens": args.max_tokens,
    }
    config |= {
        _dest(flag): getattr(args, _dest(flag))
        for flag, (workload, _) in WORKLOAD_FLAGS.items()
        if workload == args.workload
    }
    if args.workload == "random":
        config["prompt_file"] = str(args.prompt_file or "")
    if args.workload == "long-prompt":
        from nxdplug.plugins.serve.benchmark.workloads import LONG_PROMPT_NEW_TOKENS

        config["long_prompt_max_tokens"] = LONG_PROMPT_NEW_TOKENS
    started = args.base_url is None
    return config | {
        "server_options": server_options(args) if started else None,
        "serve_options": args.serve_options if started else None,
        "compare_server_options": args.compare_server_options,
        "runs": runs,
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as a table: a column per server, then the first nxdplug server's ratio to
    each other one (with several runs: the medians, after each run's output tok/s)."""
    c = report["config"]
    labels = [label for label in report if label not in ("config", "ratios", "runs")]
    ratios = report.get("ratios", {})
    lines = [
        f"model     {c['model']}"
        + (f", compiled in {c['compiled_model_path']}" if c["compiled_model_path"] else ""),
        f"load      {_describe_load(c)}",
    ]
    if c["server_options"]:
        lines.append(f"nxdplug   {c['server_options']} {c['serve_options'] or ''}".rstrip())
    if "runs" in report:
        lines += ["", f"medians of {c['runs']} runs (the servers in turn):"]
        for number, run in enumerate(report["runs"], start=1):
            figures = ", ".join(
                f"{label} {run[label]['output_tokens_per_s']:.1f}" for label in labels
            )
            run_ratios = [r.get("output_tokens_per_s") for r in run.get("ratios", {}).values()]
            ratio = ", ".join(f"x{r:.2f}" if r else "-" for r in run_ratios)
            lines.append(
                f"  run {number}: output tok/s {figures}" + (f" ({ratio})" if ratio else "")
            )
    lines += ["", *_table(report, labels, ratios)]
    if ratios:
        lines.append("")
    for label, figures in ratios.items():
        parts = [
            f"{title} x{figures[key]:.2f}"
            for title, key in SUMMARY_RATIOS[c["workload"]]
            if key in figures
        ]
        lines.append(f"nxdplug / {label}: {', '.join(parts)}")
    return "\n".join(lines)


def _describe_load(c: dict[str, Any]) -> str:
    """The report's load line, from its config."""
    if c["workload"] == "multi-turn":
        return (
            f"{c['conversations']} conversations of {c['turns']} turns, a shared "
            f"{c['system_prompt_length']}-token system prompt, {c['prompt_length']}-token "
            f"user parts, {c['max_tokens']} new tokens a turn"
        )
    if c["workload"] == "long-prompt":
        return (
            f"{c['streams']} streams of {c['max_tokens']} new tokens ({c['prompt_length']}-token "
            f"prompts); after {c['long_prompt_after']} tokens each, one "
            f"{c['long_prompt_length']}-token prompt for {c['long_prompt_max_tokens']} tokens"
        )
    prompts = c["prompt_file"] or f"{c['prompt_length']}-token random"
    return (
        f"{c['num_requests']} requests, {c['concurrency']} concurrent, {prompts} prompts, "
        f"{c['max_tokens']} new tokens each"
    )


def _table(report: dict[str, Any], labels: list[str], ratios: dict[str, Any]) -> list[str]:
    """A row per figure some server has: its value for each server, then the ratios (headed
    "ratio" for one other server, "vs LABEL" for several)."""
    if len(ratios) == 1:
        header = ["", *labels, "ratio"]
    else:
        header = ["", *labels, *(f"vs {label}" for label in ratios)]
    rows = [header]
    for title, key, fmt in (*TABLE_ROWS[report["config"]["workload"]], *SERVER_ROWS):
        if not any(key in report[label] for label in labels):
            continue
        row = [title] + [
            fmt.format(report[label][key]) if key in report[label] else "-" for label in labels
        ]
        row += [f"{r[key]:.2f}" if key in r else "-" for r in ratios.values()]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return [
        "  ".join(
            [row[0].ljust(widths[0])]
            + [v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=True)]
        )
        for row in rows
    ]
