"""`nxdplug benchmark`: the statistics, the report's shape, the ceiling's inputs, the command.

Nothing here asserts on a speed: the machine running the tests is shared and noisy.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
from transformers import AutoModelForCausalLM

from nxdplug.cli.main import build_parser, main
from nxdplug.plugins.benchmark.cli import _hf_modes, benchmark_options
from nxdplug.plugins.benchmark.measurements import (
    BenchmarkReport,
    DecodeBytes,
    GenerationStats,
    LatencyStats,
    RunTimes,
    decode_bytes_per_step,
    mean_decode_positions,
    measure_read_bandwidth,
    percentile,
    weight_bytes,
)
from nxdplug.plugins.benchmark.roofline import PrefillCeiling, PrefillFlops

SMALL_RUN = ["--runs", "1", "--prompt-length", "8", "--max-new-tokens", "4", "--quiet"]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def llama_path(tiny_checkpoint):
    return tiny_checkpoint("llama")


# percentiles and statistics -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([7.0], 99, 7.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),  # rank 1.5: halfway between 2 and 3
        ([1.0, 2.0, 3.0, 4.0], 90, 3.7),  # rank 2.7
        ([4.0, 1.0, 3.0, 2.0], 0, 1.0),  # unsorted input; p0 is the minimum
        ([4.0, 1.0, 3.0, 2.0], 100, 4.0),
        ([10.0, 20.0], 99, 19.9),
    ],
)
def test_percentile_interpolates_linearly_between_ranks(values, q, expected) -> None:
    assert percentile(values, q) == pytest.approx(expected)


@pytest.mark.parametrize("values", [[3.0, 1.0, 2.0], [5.0, 1.0, 9.0, 2.0, 8.0, 4.0, 7.0]])
def test_percentile_agrees_with_statistics_quantiles_inclusive(values) -> None:
    cuts = statistics.quantiles(values, n=100, method="inclusive")  # cuts[k - 1] is pk
    for q in (10, 50, 90, 99):
        assert percentile(values, q) == pytest.approx(cuts[q - 1])


def test_percentile_refuses_nothing_and_out_of_range() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"0\.\.100"):
        percentile([1.0], 101)


def test_stats_derive_from_token_timestamps() -> None:
    # binary fractions, so that every difference is exact
    runs = [
        RunTimes(start=0.0, tokens=(0.125, 0.25, 0.375), end=0.5),
        RunTimes(start=1.0, tokens=(1.375, 1.5, 1.75), end=2.0),
    ]
    assert runs[1].ttft == 0.375
    assert runs[1].steps == [0.125, 0.25]
    assert runs[1].e2e == 1.0
    stats = GenerationStats.from_runs(runs, batch_size=2)
    assert stats.new_tokens == 3
    assert stats.ttft == 0.25  # median over runs
    assert stats.e2e == 0.75
    assert stats.per_token == LatencyStats.from_samples([0.125, 0.125, 0.125, 0.25])
    assert stats.per_token.count == 4
    assert stats.decode_tokens_per_s == 2 / 0.125
    assert stats.throughput_tokens_per_s == 2 * 3 / 0.75


def test_mean_positions_average_the_token_generation_steps() -> None:
    prompt, new_tokens = 8, 5
    attended = [prompt + k for k in range(1, new_tokens)]
    assert mean_decode_positions(prompt, new_tokens) == statistics.mean(attended)


# the report -----------------------------------------------------------------------------------


# torch.compile imports torch.utils.mkldnn, whose import warns (shown under pytest only).
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_json_report_shape_and_ratios(capsys, llama_path) -> None:
    """--compare-hf alone: HF eager and HF with a static cache and torch.compile, each with
    its ratios, and every system against both ceilings."""
    code, out, err = run_cli(
        capsys, "benchmark", "--model-path", str(llama_path), "--compare-hf", "--json", *SMALL_RUN
    )
    assert code == 0, err
    assert err == ""  # --quiet
    report = json.loads(out)
    assert set(report) == {
        "config",
        "nxdplug",
        "hf",
        "hf_compiled",
        "base",
        "ratios",
        "ratios_hf_compiled",
        "ratios_base",
        "warmup_s",
        "bandwidth",
        "compute",
        "memory",
    }
    systems = ("nxdplug", "hf", "hf_compiled")
    assert report["config"]["backend"] == "eager"
    assert report["base"] is None and "base" not in report["config"]  # no feature options
    assert report["config"]["new_tokens"] == 4 and report["config"]["prompt_length"] == 8
    assert set(report["nxdplug"]) == set(report["hf"]) == set(report["ratios"])
    assert set(report["hf_compiled"]) == set(report["ratios_hf_compiled"]) == set(report["hf"])
    for baseline, ratios in (("hf", "ratios"), ("hf_compiled", "ratios_hf_compiled")):
        for key, ratio in report[ratios].items():
            assert ratio == report["nxdplug"][key] / report[baseline][key]
    assert set(report["warmup_s"]) == set(systems)  # apart from the timings
    bandwidth = report["bandwidth"]
    assert (
        bandwidth["bytes_per_step"]
        == bandwidth["weight_bytes"] + bandwidth["kv_cache_bytes_per_step"]
    )
    for name in systems:
        fraction = bandwidth["fraction_of_ceiling"][name]
        expected = report[name]["decode_tokens_per_s"] / bandwidth["ceiling_tokens_per_s"]
        assert fraction == pytest.approx(expected)
    compute = report["compute"]
    flops = compute["prefill_flops"]
    assert flops["total"] == flops["weights"] + flops["attention"] + flops["lm_head"]
    floor_ms = flops["total"] / (compute["gemm_gflop_per_s"] * 1e9) * 1e3
    assert compute["ttft_floor_ms"] == pytest.approx(floor_ms)
    for name in systems:
        expected = compute["ttft_floor_ms"] / report[name]["ttft_ms"]
        assert compute["fraction_of_ceiling"][name] == pytest.approx(expected)
    # every weight once (the tied head not twice), and a process holding them holds more
    memory = report["memory"]
    hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    assert memory["model_weight_bytes"] == sum(p.numel() * 4 for p in hf.parameters())
    assert memory["peak_rss_bytes"] > memory["model_weight_bytes"]


def test_compare_hf_table_has_both_columns(capsys, llama_path) -> None:
    code, out, _ = run_cli(
        capsys, "benchmark", "--model-path", str(llama_path), "--compare-hf", "eager", *SMALL_RUN
    )
    assert code == 0
    header = next(line for line in out.splitlines() if "nxdplug/HF" in line and "HF " in line)
    assert header.split() == ["nxdplug", "HF", "nxdplug/HF"]
    for label in (
        "TTFT (ms)",
        "decode (tok/s)",
        "per-token p99 (ms)",
        "end-to-end (ms)",
        "of ceiling",
        "prefill of ceiling",
    ):
        row = next(line for line in out.splitlines() if line.startswith(label))
        assert len(row.removeprefix(label).split()) == 3
    assert "ceiling" in out and "GB/s" in out
    assert "GFLOP/s" in out and "FLOPs/prefill" in out
    assert "HF-compiled" not in out


def test_compare_hf_without_a_mode_means_both() -> None:
    def modes(*argv: str) -> tuple[str, ...]:
        return _hf_modes(build_parser().parse_args(["benchmark", "--model-path", "m", *argv]))

    assert modes() == ()
    assert modes("--compare-hf") == ("eager", "compiled")
    assert modes("--compare-hf", "compiled") == ("compiled",)
    assert modes("--compare-hf", "compiled", "eager") == ("eager", "compiled")


def test_a_failing_hf_compile_is_one_error_and_no_table(capsys, llama_path, monkeypatch) -> None:
    def broken_compile(function, **options):
        def compiled(*args, **kwargs):
            raise RuntimeError("inductor could not build this graph\n(and more lines)")

        return compiled

    monkeypatch.setattr(torch, "compile", broken_compile)
    argv = ["--model-path", str(llama_path), "--compare-hf", *SMALL_RUN]
    code, out, err = run_cli(capsys, "benchmark", *argv)
    assert code == 1 and out == ""
    assert err == (
        "nxdplug: error: HF transformers (hf_compiled) failed in its warm-up, so no table is "
        "printed: RuntimeError: inductor could not build this graph\n"
    )


CONFIG = {
    "model": "m",
    "dtype": "float32",
    "batch_size": 1,
    "prompt_length": 8,
    "new_tokens": 2,
    "runs": 1,
    "backend": "eager",
    "torch": "x",
    "threads": 1,
}


def stats_of(ttft: float, step: float) -> GenerationStats:
    run = RunTimes(start=0.0, tokens=(ttft, ttft + step), end=ttft + step)
    return GenerationStats.from_runs([run], batch_size=1)


def test_table_without_hf_has_one_column() -> None:
    report = BenchmarkReport(
        config=CONFIG,
        nxdplug=stats_of(0.1, 0.1),
        hf=None,
        read_gb_per_s=10.0,
        bytes_per_step=DecodeBytes(weights=900, kv_cache=100),
        mean_positions=9.0,
    )
    assert report.ratios() is None
    assert report.ceiling_tokens_per_s == pytest.approx(10e9 / 1000)
    assert report.to_dict()["hf"] is None
    assert "HF" not in report.format_table()


def test_table_with_both_hf_modes_has_a_ratio_column_each() -> None:
    report = BenchmarkReport(
        config=CONFIG,
        nxdplug=stats_of(0.25, 0.125),
        hf=stats_of(0.5, 0.5),
        read_gb_per_s=16e-6,  # a ceiling of 16 tok/s
        bytes_per_step=DecodeBytes(weights=900, kv_cache=100),
        mean_positions=9.0,
        hf_compiled=stats_of(1.0, 0.25),
        warmup_seconds={"nxdplug": 1.0, "hf": 2.0, "hf_compiled": 30.0},
        prefill=PrefillCeiling(
            gemm_flops_per_s=1e6,
            flops=PrefillFlops(weights=80_000, attention=15_000, lm_head=5_000),
        ),
    )
    lines = report.format_table().splitlines()
    header = next(line for line in lines if line.split()[:1] == ["nxdplug"])
    assert header.split() == ["nxdplug", "HF", "nxdplug/HF", "HF-compiled", "nxdplug/HF-compiled"]
    cells = {
        label: line.removeprefix(label).split()
        for label in ("TTFT (ms)", "decode (tok/s)", "of ceiling", "prefill of ceiling")
        for line in lines
        if line.startswith(label)
    }
    assert cells["TTFT (ms)"] == ["250.00", "500.00", "0.50", "1000.00", "0.25"]
    assert cells["decode (tok/s)"] == ["8.0", "2.0", "4.00", "4.0", "2.00"]
    # decode tok/s over 16; prefill: a floor of 100_000 FLOPs at 1e6 FLOP/s over each TTFT
    assert cells["of ceiling"] == ["50.0%", "12.5%", "4.00", "25.0%", "2.00"]
    assert cells["prefill of ceiling"] == ["40.0%", "20.0%", "2.00", "10.0%", "4.00"]
    assert any(line.startswith("nxdplug/HF-compiled: decode tok/s x2.00") for line in lines)
    assert any(line.startswith("warm-up") and "HF-compiled 30.0 s" in line for line in lines)
    assert report.to_dict()["ratios_hf_compiled"]["ttft_ms"] == 0.25


# the ceiling's inputs -------------------------------------------------------------------------


def test_read_bandwidth_is_positive_and_finite() -> None:
    gb_per_s = measure_read_bandwidth(nbytes=2**22, repeats=2)
    assert gb_per_s > 0 and math.isfinite(gb_per_s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_per_step_count_each_table_as_read(tiny_checkpoint, dtype) -> None:
    from nxdplug import NeuronConfig, from_pretrained

    untied_path = tiny_checkpoint("llama")
    tied_path = tiny_checkpoint("llama", tie_word_embeddings=True)
    sizes = {}
    for name, path in (("untied", untied_path), ("tied", tied_path)):
        model = from_pretrained(path, NeuronConfig(seq_len=16, torch_dtype=dtype))
        sizes[name] = decode_bytes_per_step(model, batch_size=1, positions=0)
    config = model.config
    # Untied, a step reads the LM head whole and one row of the separate input embedding;
    # tied, the one table whole.
    row = config.hidden_size * dtype.itemsize
    assert sizes["tied"] == DecodeBytes(weights=sizes["untied"].weights - row, kv_cache=0)

    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(tied_path), dtype=dtype)
    assert weight_bytes(hf_model, dtype, tie_word_embeddings=True) == sizes["tied"].weights


def test_kv_cache_bytes_follow_batch_and_positions(llama_path) -> None:
    from nxdplug import NeuronConfig, from_pretrained

    model = from_pretrained(llama_path, NeuronConfig(seq_len=16, torch_dtype=torch.float32))
    config = model.config
    kv_heads = config.num_key_value_heads
    head_dim = config.hidden_size // config.num_attention_heads
    expected = 2 * config.num_hidden_layers * 3 * kv_heads * head_dim * 4 * 10
    assert decode_bytes_per_step(model, batch_size=3, positions=10).kv_cache == expected


# the command ----------------------------------------------------------------------------------


def test_lengths_default_to_the_benchmark_and_backend_sets_compile_backend() -> None:
    args = build_parser().parse_args(
        ["benchmark", "--model-path", "m", "--prompt-length", "20", "--backend", "eager"]
    )
    assert benchmark_options(args) == {
        "seq_len": 148,
        "max_context_length": 20,
        "compile_backend": "eager",
    }
    # A longer seq_len does not widen the prompt's graph (the default prompt is 128 tokens).
    args = build_parser().parse_args(["benchmark", "--model-path", "m", "--seq-len", "512"])
    assert benchmark_options(args) == {"seq_len": 512, "max_context_length": 128}
    # Buckets asked for: max_context_length follows seq_len, as NxD Inference's does.
    args = build_parser().parse_args(
        ["benchmark", "--model-path", "m", "--seq-len", "512", "--enable-bucketing"]
    )
    assert benchmark_options(args) == {"seq_len": 512, "enable_bucketing": True}


def test_missing_model_path_is_one_error(capsys, tmp_path) -> None:
    missing = tmp_path / "missing"
    code, out, err = run_cli(capsys, "benchmark", "--model-path", str(missing), "--quiet")
    assert code == 1 and out == ""
    assert err == f"nxdplug: error: --model-path {missing} is not a folder\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-new-tokens", "1"], "--max-new-tokens must be at least 2"),
        (["--seq-len", "10"], "= 256 exceeds seq_len 10"),
    ],
)
def test_lengths_that_cannot_be_benchmarked_are_one_error(capsys, llama_path, argv, message):
    code, _, err = run_cli(capsys, "benchmark", "--model-path", str(llama_path), *argv)
    assert code == 1
    assert err.startswith("nxdplug: error: ") and message in err
    assert err.count("\n") == 1
