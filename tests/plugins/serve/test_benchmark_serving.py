"""``nxdplug benchmark-serving``: the load generator and its workloads against a real ``nxdplug
serve`` on a tiny checkpoint, and the command end to end (transformers serve is left out: too
slow here)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from nxdplug.cli.main import build_parser, main
from nxdplug.errors import NxdPlugError
from nxdplug.plugins.serve.benchmark.cli import (
    NXDPLUG_COMMAND,
    build_report,
    format_report,
    nxdplug_server,
)
from nxdplug.plugins.serve.benchmark.load import (
    ServingLoadResult,
    read_prompt_file,
    run_serving_load,
    sse_events,
    synthetic_prompts,
)
from nxdplug.plugins.serve.benchmark.server_metrics import parse_prometheus_text, server_figures
from nxdplug.plugins.serve.benchmark.server_process import free_port, running_server
from nxdplug.plugins.serve.benchmark.workloads import run_multi_turn_load
from nxdplug.testing.tiny_models import make_tiny_checkpoint

SERVE_OPTIONS = ["--seq-len", "64", "--max-context-length", "32", "--torch-dtype", "float32"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("bench") / "ckpt", seed=1)


@pytest.fixture(scope="module")
def base_url(checkpoint: Path) -> Iterator[str]:
    port = free_port()
    command = [
        sys.executable, *NXDPLUG_COMMAND, "serve", "--model-path", str(checkpoint),
        "--served-model-name", "tiny", "--port", str(port), "--batch-size", "4",
        "--log-level", "warning", "--enforce-eager", *SERVE_OPTIONS,
    ]  # fmt: skip
    with running_server(command, f"http://127.0.0.1:{port}/health", 120):
        yield f"http://127.0.0.1:{port}/v1"


def test_load_counts_every_request_and_token(checkpoint: Path, base_url: str) -> None:
    from transformers import AutoTokenizer

    prompts = synthetic_prompts(AutoTokenizer.from_pretrained(str(checkpoint)), 8, 16, seed=3)
    result = run_serving_load(base_url, "tiny", prompts, 8, 4, 8, {"ignore_eos": True})

    assert isinstance(result, ServingLoadResult)
    assert result.requests == 8
    assert result.output_tokens == 8 * 8
    assert result.prompt_tokens >= 8 * 16
    assert 8 <= result.chunks <= 8 * 8
    for stats in (result.ttft, result.itl, result.tpot, result.e2e):
        assert 0 < stats.p50 <= stats.p90 <= stats.p99
    assert result.ttft.p99 <= result.e2e.p99
    assert result.requests_per_s == pytest.approx(8 / result.duration_s)
    # Each request lasts at most the whole run; 8 requests 4 at a time take two of them at least.
    assert result.e2e.p99 <= result.duration_s <= 8 * result.e2e.p99


def test_load_reports_a_refused_request(base_url: str) -> None:
    with pytest.raises(NxdPlugError, match="failed"):
        run_serving_load(base_url, "no-such-model", ["hello"], 4, 1, 1)


def test_clients_without_the_aiohttp_transport_say_what_to_install(monkeypatch) -> None:
    import openai

    class Missing:
        def __init__(self, **_: object) -> None:
            raise RuntimeError("the aiohttp extra is not installed")

    monkeypatch.setattr(openai, "DefaultAioHttpClient", Missing)
    with pytest.raises(NxdPlugError, match=r"pip install 'openai\[aiohttp\]"):
        run_serving_load("http://127.0.0.1:9/v1", "tiny", ["hello"], 4, 1, 1)


def test_command_without_the_client_packages_says_what_to_install(
    checkpoint: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # as if it were not installed
    argv = ["benchmark-serving", "--model-path", str(checkpoint)]
    assert main([*argv, "--base-url", "http://127.0.0.1:9/v1", "--quiet"]) == 1
    assert "pip install 'openai[aiohttp]>=1.89'" in capsys.readouterr().err


def test_synthetic_prompts_are_seeded_and_of_the_length(checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    prompts = synthetic_prompts(tokenizer, 6, 24, seed=5)
    assert prompts == synthetic_prompts(tokenizer, 6, 24, seed=5)
    assert prompts != synthetic_prompts(tokenizer, 6, 24, seed=6)
    assert all(abs(len(tokenizer.encode(p)) - 24) <= 2 for p in prompts)


def test_prompt_file_takes_lines_or_json_lines(tmp_path: Path) -> None:
    plain = tmp_path / "plain.txt"
    plain.write_text("first prompt\n\nsecond prompt\n")
    assert read_prompt_file(plain) == ["first prompt", "second prompt"]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "a"}\n{"text": "b", "input_ids": [1]}\n')
    assert read_prompt_file(jsonl) == ["a", "b"]
    jsonl.write_text('{"input_ids": [1]}\n')
    with pytest.raises(NxdPlugError, match="line 1"):
        read_prompt_file(jsonl)


def test_command_starts_the_server_and_reports_json(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "benchmark-serving", "--model-path", str(checkpoint), "--concurrency", "2",
        "--num-requests", "4", "--prompt-length", "8", "--max-tokens", "4", "--json",
        "--quiet", "--enforce-eager", *SERVE_OPTIONS,
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["server_options"]["batch_size"] == 2
    assert report["nxdplug"]["requests"] == 4
    assert report["nxdplug"]["output_tokens"] == 4 * 4
    assert report["nxdplug"]["ttft_p50_ms"] > 0
    assert "transformers" not in report


@pytest.mark.parametrize("eager", [False, True])
def test_the_server_command_compiles_unless_told_not_to(checkpoint: Path, eager: bool) -> None:
    """``nxdplug serve`` compiles by default; --enforce-eager is passed on to it."""
    argv = ["benchmark-serving", "--model-path", str(checkpoint), *SERVE_OPTIONS]
    args = build_parser().parse_args(argv + (["--enforce-eager"] if eager else []))
    command = nxdplug_server(args).command
    assert command[1 : len(NXDPLUG_COMMAND) + 2] == [*NXDPLUG_COMMAND, "serve"]
    assert ("--enforce-eager" in command) is eager


def test_command_loads_a_running_server(
    checkpoint: Path, base_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "benchmark-serving", "--model-path", str(checkpoint), "--base-url", base_url,
        "--concurrency", "2", "--num-requests", "2", "--prompt-length", "8", "--max-tokens", "3",
        "--quiet",
    ]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "output tok/s" in table and "TTFT p99 (ms)" in table
    assert main([*argv, "--compare-transformers-serve"]) == 1
    assert "--base-url loads a running server" in capsys.readouterr().err

    assert main([*argv, "--runs", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    per_run = [run["server"]["output_tokens_per_s"] for run in report["runs"]]
    assert len(per_run) == 2
    assert report["server"]["output_tokens_per_s"] == pytest.approx(sum(per_run) / 2)
    assert main([*argv, "--runs", "2"]) == 0
    assert "medians of 2 runs" in capsys.readouterr().out


async def _lines(*lines: str) -> AsyncIterator[str]:
    for line in lines:
        yield line


def _events(*lines: str) -> list[dict]:
    async def collect() -> list[dict]:
        return [event async for event in sse_events(_lines(*lines), "server")]

    return asyncio.run(collect())


def test_stream_events_are_read_as_the_sse_format_defines_them() -> None:
    events = _events(
        ": a comment",
        'data: {"choices": [{"text": "a"}]}',
        "",
        "event: completion",
        'data:{"choices": [],',
        'data: "usage": {"completion_tokens": 1}}',
        "",
        "",
        "data: [DONE]",
        "",
        'data: {"after": "done"}',
        "",
    )
    assert events == [
        {"choices": [{"text": "a"}]},
        {"choices": [], "usage": {"completion_tokens": 1}},
    ]


@pytest.mark.parametrize(
    ("payload", "message"),
    [("not json", "not JSON"), ('{"error": {"message": "boom"}}', "error"), ("[1]", "unexpected")],
)
def test_a_stream_event_that_is_no_chunk_fails_the_run(payload: str, message: str) -> None:
    with pytest.raises(NxdPlugError, match=message):
        _events(f"data: {payload}", "")


def test_several_runs_report_their_medians_and_each_runs_ratio() -> None:
    args = build_parser().parse_args(
        ["benchmark-serving", "--model-path", "m", "--runs", "3", *SERVE_OPTIONS]
    )
    figures = [(900.0, 300.0, 40.0), (1200.0, 300.0, 30.0), (1000.0, 500.0, 20.0)]
    runs = [
        {
            "nxdplug": {"output_tokens_per_s": ours, "ttft_p99_ms": ttft, "itl_p50_ms": 10.0},
            "transformers": {
                "output_tokens_per_s": theirs,
                "ttft_p99_ms": 80.0,
                "itl_p50_ms": 30.0,
            },
        }
        for ours, theirs, ttft in figures
    ]
    report = build_report(args, runs)
    assert report["config"]["runs"] == 3
    assert report["nxdplug"]["output_tokens_per_s"] == 1000.0
    assert report["transformers"]["output_tokens_per_s"] == 300.0
    # The median of each run's ratio (3.0, 4.0, 2.0), not the ratio of the medians (3.33).
    ratios = report["ratios"]["transformers"]
    assert ratios["output_tokens_per_s"] == 3.0
    assert ratios["ttft_p99_ms"] == 0.375
    per_run = [run["ratios"]["transformers"]["output_tokens_per_s"] for run in report["runs"]]
    assert per_run == [3.0, 4.0, 2.0]
    assert "(x3.00)" in format_report(report)


def test_compared_servers_get_a_ratio_column_each_and_missing_figures_a_dash() -> None:
    args = build_parser().parse_args(
        ["benchmark-serving", "--model-path", "m", "--workload", "multi-turn", *SERVE_OPTIONS]
    )
    other = "nxdplug --no-enable-prefix-caching"
    run = {
        "nxdplug": {"output_tokens_per_s": 40.0, "prefix_cache_hit_rate": 0.5},
        other: {"output_tokens_per_s": 20.0, "prefix_cache_hit_rate": 0.0},
        "transformers": {"output_tokens_per_s": 10.0},
    }
    report = build_report(args, [run])
    assert report["ratios"] == {
        other: {"output_tokens_per_s": 2.0},  # no ratio to a hit rate of 0
        "transformers": {"output_tokens_per_s": 4.0},
    }
    table = format_report(report)
    assert f"vs {other}" in table and "vs transformers" in table
    hit_rate = next(line for line in table.splitlines() if line.startswith("prefix-cache"))
    # The three servers' values, then the two ratios.
    assert hit_rate.split()[-5:] == ["0.500", "0.000", "-", "-", "-"]
    assert f"nxdplug / {other}: output tok/s x2.00" in table


def test_the_compared_servers_add_their_options_last(checkpoint: Path) -> None:
    argv = ["benchmark-serving", "--model-path", str(checkpoint), *SERVE_OPTIONS]
    argv += ["--serve-options=--enable-prefix-caching --block-size 16"]
    args = build_parser().parse_args(argv)
    server = nxdplug_server(args, ["--no-enable-prefix-caching"])
    assert server.label == "nxdplug --no-enable-prefix-caching"
    assert server.command[-4:] == [
        "--enable-prefix-caching", "--block-size", "16", "--no-enable-prefix-caching"
    ]  # fmt: skip
    assert nxdplug_server(args).label == "nxdplug"


def test_server_metrics_are_read_from_the_prometheus_text() -> None:
    samples = parse_prometheus_text(
        "# HELP nxdplug:num_requests_running requests\n"
        "nxdplug:num_requests_running 3.0\n"
        'nxdplug:request_success_total{finished_reason="length"} 2.0\n'
        'nxdplug:request_success_total{finished_reason="stop"} 1.0 1700000000\n'
        "nxdplug:prefix_cache_hits_total 30.0\n"
        "nxdplug:prefix_cache_queries_total 100.0\n"
        "nxdplug:spec_decode_num_drafts_total 40.0\n"
        "nxdplug:spec_decode_num_draft_tokens_total 160.0\n"
        "nxdplug:spec_decode_num_accepted_tokens_total 90.0\n"
        'nxdplug:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 35.0\n'
    )
    assert samples["nxdplug:num_requests_running"] == 3.0
    assert samples["nxdplug:request_success_total"] == 3.0
    before = {
        "nxdplug:prefix_cache_hits_total": 10.0,
        "nxdplug:prefix_cache_queries_total": 60.0,
        "nxdplug:spec_decode_num_drafts_total": 10.0,
        "nxdplug:spec_decode_num_draft_tokens_total": 40.0,
        "nxdplug:spec_decode_num_accepted_tokens_total": 30.0,
    }
    # The timed load alone: hits (30 - 10) / (100 - 60); kept (90 - 30) / (160 - 40) of the
    # proposed tokens, 1 + (90 - 30) / (40 - 10) tokens a verification.
    assert server_figures(before, samples, [1.0, 4.0, 2.0]) == {
        "peak_running_requests": 4.0,
        "server_prefix_cache_hit_rate": 0.5,
        "spec_acceptance_rate": 0.5,
        "spec_tokens_per_verification": 3.0,
    }
    assert server_figures({}, {}, []) == {}


def test_multi_turn_conversations_resend_what_the_server_replied(
    checkpoint: Path, base_url: str
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    system = synthetic_prompts(tokenizer, 1, 8, seed=1)[0]
    users = [synthetic_prompts(tokenizer, 2, 4, seed=2), synthetic_prompts(tokenizer, 2, 4, seed=3)]
    result = run_multi_turn_load(base_url, "tiny", system, users, 4, {"ignore_eos": True})

    assert [len(turn) for turn in result.turns] == [2, 2]
    for first, second in zip(*result.turns, strict=True):
        assert first.text and first.output_tokens == 4
        # The second turn sends the first's prompt, its reply and a new user part.
        assert second.prompt_tokens >= first.prompt_tokens + 4 + 2
    figures = result.to_dict()
    assert figures["requests"] == 4
    assert figures["ttft_first_turn_p50_ms"] > 0 and figures["ttft_later_turns_p99_ms"] > 0
    assert figures["prefix_cache_hit_rate"] == 0.0  # no prefix caching on this server


def test_multi_turn_reports_the_prefix_caches_hits_of_each_server(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "benchmark-serving", "--model-path", str(checkpoint), "--workload", "multi-turn",
        "--conversations", "2", "--turns", "3", "--system-prompt-length", "48",
        "--prompt-length", "8", "--max-tokens", "4", "--enforce-eager", "--json", "--quiet",
        "--seq-len", "128", "--max-context-length", "112", "--torch-dtype", "float32",
        "--serve-options=--enable-prefix-caching --block-size 16",
        "--compare-server-options=--no-enable-prefix-caching",
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    cached, uncached = report["nxdplug"], report["nxdplug --no-enable-prefix-caching"]
    assert cached["requests"] == uncached["requests"] == 6
    assert cached["ttft_later_turns_p50_ms"] > 0
    assert 0 < cached["prefix_cache_hit_rate"] < 1
    assert cached["server_prefix_cache_hit_rate"] > 0
    # polled every 100 ms: a loaded machine may let a short load slip between two polls
    assert 0 <= cached["peak_running_requests"] <= 2
    assert uncached["prefix_cache_hit_rate"] == 0
    assert uncached.get("server_prefix_cache_hit_rate", 0) == 0
    ratios = report["ratios"]["nxdplug --no-enable-prefix-caching"]
    assert ratios["output_tokens_per_s"] > 0
    assert report["config"]["compare_server_options"] == ["--no-enable-prefix-caching"]


def test_long_prompt_reports_the_streams_itl_and_the_long_prompts_ttft(
    checkpoint: Path, base_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "benchmark-serving", "--model-path", str(checkpoint), "--base-url", base_url,
        "--workload", "long-prompt", "--streams", "2", "--prompt-length", "8",
        "--max-tokens", "8", "--long-prompt-after", "2", "--long-prompt-length", "24",
        "--warmup-requests", "1", "--quiet", "--json",
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    figures = report["server"]
    assert 0 < figures["itl_p50_ms"] <= figures["itl_p99_ms"] < float("inf")
    assert figures["itl_p99_over_p50"] >= 1
    assert figures["itl_max_ms"] >= figures["itl_p99_ms"]
    assert figures["long_prompt_ttft_ms"] > 0
    assert figures["long_prompt_tokens"] >= 22
    assert figures["output_tokens"] == 2 * 8 + 4
    # polled every 100 ms: a load this short may end between two polls
    assert figures["peak_running_requests"] >= 0
    assert "long prompt TTFT (ms)" in format_report(report)


@pytest.mark.parametrize(
    ("flags", "code", "message"),
    [
        (["--workload", "multi-turn", "--turns", "0"], 2, "argument --turns: expected a positive"),
        (
            ["--base-url", "http://127.0.0.1:9/v1", "--compare-server-options=--block-size 16"],
            1,
            "--base-url loads a running server",
        ),
        (["--conversations", "3"], 1, "--conversations applies to --workload multi-turn"),
        (
            ["--workload", "long-prompt", "--long-prompt-after", "64"],
            1,
            "--long-prompt-after 64 must be below --max-tokens 64",
        ),
        (["--compare-server-options=--bogus"], 1, "unrecognized arguments: --bogus"),
        (["--compare-server-options= "], 1, "names no option"),
        (
            ["--compare-server-options=--batch-size 2"],
            1,
            "batch_size is given both as --batch-size",
        ),
    ],
)
def test_flags_that_cannot_work_are_refused_before_a_server_starts(
    flags: list[str], code: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["benchmark-serving", "--model-path", "no-such-dir", "--quiet", *flags]
    assert main(argv) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
