"""``nxdplug benchmark-serving``: the load generator against a real ``nxdplug serve`` on a tiny
checkpoint, and the command end to end (transformers serve is left out: too slow here)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from nxdplug.benchmark.server_process import free_port, running_server
from nxdplug.benchmark.serving_load import (
    ServingLoadResult,
    read_prompt_file,
    run_serving_load,
    sse_events,
    synthetic_prompts,
)
from nxdplug.cli.benchmark_serving import NXDPLUG_COMMAND, build_report, nxdplug_server
from nxdplug.cli.main import build_parser, main
from nxdplug.errors import NxdPlugError
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
    assert report["ratios"]["output_tokens_per_s"] == 3.0
    assert report["ratios"]["ttft_p99_ms"] == 0.375
    assert [run["ratios"]["output_tokens_per_s"] for run in report["runs"]] == [3.0, 4.0, 2.0]
