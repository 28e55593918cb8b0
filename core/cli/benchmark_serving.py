"""``nxdplug benchmark-serving``: throughput and latency of an OpenAI-compatible server under
concurrent streamed requests, as vLLM's ``benchmark_serving.py`` measures them.

Without ``--base-url`` it starts ``nxdplug serve`` on a free local port, sends warm-up
requests, runs the load and stops the server; with ``--compare-transformers-serve`` it then
does the same with HF ``transformers serve --continuous-batching`` on the same checkpoint and
dtype (one server at a time) and prints both with their ratios. ``--runs N`` does all of that
N times, the servers in turn, and reports each metric's median (the ratios: the median of
each run's ratio): on a shared machine one run of each can catch different loads. The load
itself is in :mod:`nxdplug.benchmark.serving_load`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from nxdplug.cli.options import add_neuron_config_options, neuron_config_kwargs, positive_int
from nxdplug.errors import NxdPlugError

HOST = "127.0.0.1"
# The command line of this Python's nxdplug (the nxdplug script may not be on PATH).
NXDPLUG_COMMAND = ("-m", "nxdplug.cli.main")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1"}
# transformers serve rejects fields it does not know (ignore_eos among them) but takes a whole
# generation config; an eos id of -1 matches no token.
TRANSFORMERS_NO_EOS = {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})}
NXDPLUG_NO_EOS = {"ignore_eos": True}
# (label, key in ServingLoadResult.to_dict(), format)
TABLE_ROWS = (
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
)


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
    load.add_argument("--concurrency", type=positive_int, default=16, metavar="N")
    load.add_argument("--num-requests", type=positive_int, default=64, metavar="N")
    load.add_argument(
        "--warmup-requests",
        type=positive_int,
        metavar="N",
        help="untimed requests sent to each server first, --concurrency at a time (default: "
        "--concurrency: transformers serve's first wave of concurrent requests pays a one-time "
        "cost of seconds)",
    )
    load.add_argument("--prompt-length", type=positive_int, default=64, metavar="N")
    load.add_argument(
        "--max-tokens",
        type=positive_int,
        default=64,
        metavar="N",
        help="new tokens per request (end-of-sequence is ignored, so exactly N)",
    )
    load.add_argument(
        "--prompt-file",
        type=Path,
        metavar="FILE",
        help="prompts, one per line, or JSON lines with a prompt (or text) field each, used "
        "in turn; default: --prompt-length random token ids decoded with the model's tokenizer",
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
    parser.epilog = "The server's --batch-size defaults to --concurrency (a cache line each)."


@attrs.frozen
class ServerUnderTest:
    """A server to benchmark: how to start it, what to name in requests, what to add to them."""

    label: str
    command: list[str]
    model: str
    extra_body: dict[str, Any]


def run_benchmark_serving(args: argparse.Namespace) -> int:
    def progress(message: str) -> None:
        if not args.quiet:
            print(f"benchmark-serving: {message}", file=sys.stderr, flush=True)

    from nxdplug.benchmark.serving_load import require_client_packages

    require_client_packages()
    prompts = _prompts(args)
    runs: list[dict[str, dict[str, float]]] = []
    for run in range(1, args.runs + 1):
        if args.runs > 1:
            progress(f"run {run} of {args.runs}")
        results: dict[str, dict[str, float]] = {}
        # closing(): an error in a load stops the server running at the time.
        with contextlib.closing(_servers(args, progress)) as servers:
            for label, base_url, model, extra_body in servers:
                results[label] = _measure(
                    args, label, base_url, model, extra_body, prompts, progress
                )
        runs.append(results)
    report = build_report(args, runs)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _measure(
    args: argparse.Namespace,
    label: str,
    base_url: str,
    model: str,
    extra_body: dict[str, Any],
    prompts: list[str],
    progress: Callable[[str], None],
) -> dict[str, float]:
    """Untimed warm-up requests, then the timed load."""
    from nxdplug.benchmark.serving_load import run_serving_load

    warmup = args.warmup_requests or args.concurrency
    progress(f"{label}: {warmup} warm-up request(s)")
    run_serving_load(
        base_url, model, prompts, args.max_tokens, args.concurrency, warmup, extra_body
    )
    progress(
        f"{label}: {args.num_requests} requests, {args.concurrency} at a time, "
        f"{args.max_tokens} tokens each"
    )
    result = run_serving_load(
        base_url, model, prompts, args.max_tokens, args.concurrency, args.num_requests, extra_body
    )
    return result.to_dict()


def _servers(
    args: argparse.Namespace, progress: Callable[[str], None]
) -> Iterator[tuple[str, str, str, dict[str, Any]]]:
    """``(label, base_url, model name, extra body)`` of each server in turn, each running
    while the caller loads it (and stopped when the caller asks for the next)."""
    from nxdplug.benchmark.server_process import free_port, running_server

    if args.base_url is not None:
        if args.compare_transformers_serve or args.compiled_model_path or args.enforce_eager:
            raise NxdPlugError(
                "--base-url loads a running server: --compare-transformers-serve, "
                "--compiled-model-path and --enforce-eager apply to the servers this command "
                "starts; leave them out"
            )
        base_url = args.base_url.rstrip("/")
        model = args.served_model_name or _first_model(base_url)
        yield "server", base_url, model, dict(NXDPLUG_NO_EOS)
        return
    servers = [nxdplug_server(args)]
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
    KV-cache line) per concurrent request by default."""
    return {"batch_size": args.concurrency} | neuron_config_kwargs(args)


def nxdplug_server(args: argparse.Namespace) -> ServerUnderTest:
    """The `nxdplug serve` command this benchmark starts, with the user's model options."""
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
    return ServerUnderTest("nxdplug", command, model, dict(NXDPLUG_NO_EOS))


def _transformers_server(args: argparse.Namespace) -> ServerUnderTest:
    from nxdplug.cli.inference import inference_config

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


def _prompts(args: argparse.Namespace) -> list[str]:
    from transformers import AutoConfig

    from nxdplug.benchmark.serving_load import read_prompt_file, synthetic_prompts
    from nxdplug.cli.inference import load_tokenizer

    tokenizer = load_tokenizer(args.model_path, "benchmark-serving")
    vocab_size = AutoConfig.from_pretrained(str(args.model_path)).get_text_config().vocab_size
    if len(tokenizer) < vocab_size:
        warnings.warn(
            f"the tokenizer has {len(tokenizer)} tokens and the model {vocab_size}: generated "
            "ids beyond the tokenizer stream no text, so TTFT and ITL are timed on the tokens "
            "that have some (random-weight checkpoints pick those ids often)",
            stacklevel=2,
        )
    if args.prompt_file is not None:
        return read_prompt_file(args.prompt_file)
    return synthetic_prompts(tokenizer, args.num_requests, args.prompt_length, args.seed)


def build_report(
    args: argparse.Namespace, runs: list[dict[str, dict[str, float]]]
) -> dict[str, Any]:
    """The medians over runs of each server's figures and of each run's ratios (a run's figures
    alone for one run); with several runs, each run's figures too."""
    runs = [run | _ratios(run) for run in runs]
    medians = {
        label: {
            key: statistics.median(run[label][key] for run in runs if key in run[label])
            for key in runs[0][label]
        }
        for label in runs[0]
    }
    report: dict[str, Any] = {
        "config": {
            "model": str(args.model_path),
            "compiled_model_path": str(args.compiled_model_path or ""),
            "concurrency": args.concurrency,
            "num_requests": args.num_requests,
            "prompt_length": args.prompt_length,
            "prompt_file": str(args.prompt_file or ""),
            "max_tokens": args.max_tokens,
            "server_options": server_options(args) if args.base_url is None else None,
            "runs": len(runs),
        },
        **medians,
    }
    if len(runs) > 1:
        report["runs"] = runs
    return report


def _ratios(run: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """``{"ratios": nxdplug / transformers for each figure}`` when both servers ran, else {}."""
    if "transformers" not in run:
        return {}
    ours, theirs = run["nxdplug"], run["transformers"]
    return {"ratios": {key: ours[key] / theirs[key] for key in ours if theirs[key]}}


def format_report(report: dict[str, Any]) -> str:
    """The report as a table: a column per server, then nxdplug / transformers (with several
    runs: the medians, after each run's output tok/s)."""
    c = report["config"]
    labels = [label for label in ("server", "nxdplug", "transformers") if label in report]
    header = ["", *labels] + (["ratio"] if "ratios" in report else [])
    rows = [header]
    for title, key, fmt in TABLE_ROWS:
        row = [title] + [fmt.format(report[label][key]) for label in labels]
        if "ratios" in report:
            row.append(f"{report['ratios'][key]:.2f}")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    table = [
        "  ".join(
            [row[0].ljust(widths[0])]
            + [v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=True)]
        )
        for row in rows
    ]
    prompts = c["prompt_file"] or f"{c['prompt_length']}-token random"
    lines = [
        f"model     {c['model']}"
        + (f", compiled in {c['compiled_model_path']}" if c["compiled_model_path"] else ""),
        f"load      {c['num_requests']} requests, {c['concurrency']} concurrent, "
        f"{prompts} prompts, {c['max_tokens']} new tokens each",
    ]
    if c["server_options"]:
        lines.append(f"nxdplug   {c['server_options']}")
    if "runs" in report:
        lines += ["", f"medians of {c['runs']} runs (the servers in turn):"]
        for number, run in enumerate(report["runs"], start=1):
            figures = ", ".join(
                f"{label} {run[label]['output_tokens_per_s']:.1f}" for label in labels
            )
            ratio = f" (x{run['ratios']['output_tokens_per_s']:.2f})" if "ratios" in run else ""
            lines.append(f"  run {number}: output tok/s {figures}{ratio}")
    lines += ["", *table]
    if "ratios" in report:
        r = report["ratios"]
        lines += [
            "",
            f"nxdplug / transformers: output tok/s x{r['output_tokens_per_s']:.2f}, "
            f"TTFT p99 x{r['ttft_p99_ms']:.2f}, ITL p50 x{r['itl_p50_ms']:.2f}",
        ]
    return "\n".join(lines)
