"""``nxdplug inference_demo``: NxD Inference's inference_demo flags, each accepted with its
meaning or refused in one line, and the demo's flow (compile, load, check, generate) on a tiny
random Llama."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from nxdplug.cli.main import UsageError, build_parser, main
from nxdplug.config import MoENeuronConfig, OnDeviceSamplingConfig
from nxdplug.generation.accuracy import shift_right
from nxdplug.nxdi.demo.command import main as inference_demo_main
from nxdplug.nxdi.demo.command import neuron_config_options
from nxdplug.nxdi.demo.flags import add_run_flags, attribute_flags
from tests import REPO_ROOT

ROOT = REPO_ROOT
HEAD = ["inference_demo", "--model-type", "llama", "--task-type", "causal-lm", "run"]

# Every flag of NxD Inference's inference_demo (its parse_args and setup_run_parser), the
# reference this command is measured against.
NXDI_FLAG_TEXT = """
--model-type --task-type --model-path --compiled-model-path --benchmark --check-accuracy-mode
--expected-outputs-path --divergence-difference-tol --tol-map --num-tokens-to-check --prompt
--top-k --top-p --temperature --global-topk --do-sample --dynamic --pad-token-id
--top-k-kernel-enabled --torch-dtype --batch-size --padding-side --allow-input-truncation
--seq-len --n-active-tokens --n-positions --max-context-length --max-new-tokens --max-length
--rpl-reduce-dtype --attention-dtype --output-logits --vocab-parallel --layer-boundary-markers
--fused-qkv --sequence-parallel-enabled --weight-gather-seq-len-threshold
--flash-decoding-enabled --ctx-batch-size --tkg-batch-size --max-batch-size
--is-continuous-batching --kv-cache-batch-size --kv-cache-padding-size
--disable-kv-cache-tiling --on-device-sampling --sampling-dp-degree --enable-bucketing
--bucket-n-active-tokens --context-encoding-buckets --prefix-buckets
--token-generation-buckets --quantized --quantized-checkpoints-path --quantization-type
--kv-cache-quant --k-quant-method --v-quant-method --kv-quant-dtype --kv-direct-cast
--quantization-dtype --modules-to-not-convert-file --capacity-factor
--early-expert-affinity-modulation --disable-normalize-top-k-affinities --fused-shared-experts
--router-act-fn --router-dtype --draft-model-path --draft-model-tp-degree
--compiled-draft-model-path --enable-fused-speculation --enable-eagle-speculation
--enable-eagle-draft-input-norm --speculation-length --spec-batch-size --is-medusa
--medusa-speculation-length --num-medusa-heads --medusa-tree-json --token-tree-json
--tp-degree --cp-degree --mlp-cp-degree --attention-dp-degree --pp-degree --ep-degree
--moe-tp-degree --moe-ep-degree --world-size --start_rank_id --local_ranks_size
--enable-torch-dist --save-sharded-checkpoint --skip-sharding --enable-block-kv-layout
--pa-num-blocks --pa-block-size --enable-chunked-prefill --enable-prefix-caching
--max-num-seqs --async-mode --windowed-context-encoding-size --enable-lora
--enable-dynamic-multi-lora --max-loras --max-lora-rank --target-modules --max-cpu-loras
--lora-ckpt-path --lora-ckpt-path-cpu --lora-ckpt-json --adapter-id --qkv-kernel-enabled
--qkv-nki-kernel-enabled --qkv-cte-nki-kernel-fuse-rope --qkv-kernel-nbsd-layout
--attn-kernel-enabled --strided-context-parallel-kernel-enabled --mlp-kernel-enabled
--quantized-mlp-kernel-enabled --fused-rmsnorm-skip-gamma --activation-quantization-type
--rmsnorm-quantize-kernel-enabled --quantize-clamp-bound --mlp-kernel-fuse-residual-add
--qkv-kernel-fuse-residual-add --attn-block-tkg-nki-kernel-enabled
--attn-block-tkg-nki-kernel-cascaded-attention --attn-block-tkg-nki-kernel-cache-update
--k-cache-transposed --is-eagle3 --logical-neuron-cores --logical-nc-config
--cc-pipeline-tiling-factor --enable-spill-reload-dge --scratchpad-page-size --on-cpu
--benchmark-report-path --capture-indices --input-capture-save-dir --cast-type --skip-warmup
--skip-compile --compile-only --compile-dry-run --hlo-debug --apply-seq-ids-mask
--input-start-offsets --enable-output-completion-notifications
"""
NXDI_FLAGS = NXDI_FLAG_TEXT.split()

# The features nxdplug lacks: each of these flags is refused.
REFUSED = {
    "--bucket-n-active-tokens",
    "--windowed-context-encoding-size",
    "--activation-quantization-type",
    "--apply-seq-ids-mask",
}


@pytest.fixture(scope="module")
def json_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "file.json"
    path.write_text(json.dumps({"modules_to_not_convert": ["lm_head"]}))
    return path


def sample_argv(flag: str, json_file: Path) -> list[str]:
    """``flag`` with a value it accepts (none for a switch), as a user would write it."""
    values = {
        "--model-type": [],  # in HEAD
        "--task-type": [],
        "--model-path": ["/tmp"],
        "--compiled-model-path": ["/tmp"],
        "--prompt": ["hi"],
        "--check-accuracy-mode": ["logit-matching"],
        "--torch-dtype": ["float32"],
        "--rpl-reduce-dtype": ["float32"],
        "--attention-dtype": ["float32"],
        "--padding-side": ["left"],
        "--cast-type": ["as-declared"],
        "--context-encoding-buckets": ["4", "8"],
        "--token-generation-buckets": ["8", "16"],
        "--lora-ckpt-path": ["a : /adapters/a", "--enable-lora"],
        "--lora-ckpt-path-cpu": ["b : /adapters/b", "--enable-lora"],
        "--medusa-tree-json": [str(json_file)],
        "--token-tree-json": [str(json_file)],
        "--modules-to-not-convert-file": [str(json_file)],
        "--tol-map": ["{None: (1e-5, 0.05)}"],
        "--k-quant-method": ["per_tensor_symmetric"],
        "--v-quant-method": ["per_tensor_symmetric"],
        "--kv-quant-dtype": ["float8_e4m3fn"],
        "--quantize-clamp-bound": ["inf"],
        "--capture-indices": ["0", "2"],
        "--input-start-offsets": ["2"],
        "--start_rank_id": ["0"],
        "--kv-cache-padding-size": ["0"],
        "--router-act-fn": ["sigmoid"],
        "--router-dtype": ["float32"],
        "--quantization-type": ["per_channel_symmetric"],
        "--quantization-dtype": ["f8e4m3"],
        "--capacity-factor": ["1.5"],
        "--divergence-difference-tol": ["0.01"],
        "--temperature": ["0.5"],
        "--top-p": ["0.9"],
    }
    for path_flag in (
        "--expected-outputs-path",
        "--quantized-checkpoints-path",
        "--benchmark-report-path",
        "--input-capture-save-dir",
        "--draft-model-path",
        "--compiled-draft-model-path",
    ):
        values[path_flag] = ["/tmp/x"]
    if flag in values:
        return [flag, *values[flag]] if values[flag] else []
    if flag in NEED_ENABLE_LORA:
        return ["--enable-lora", *_plain_sample(flag)]
    if flag in NEED_ON_DEVICE_SAMPLING:
        return ["--on-device-sampling", *_plain_sample(flag)]
    return _plain_sample(flag)


# The flags that mean something with another only (alone, they are an error).
NEED_ENABLE_LORA = {"--target-modules", "--max-cpu-loras", "--lora-ckpt-json", "--adapter-id"}
NEED_ON_DEVICE_SAMPLING = {"--global-topk", "--top-k-kernel-enabled", "--sampling-dp-degree"}


def _plain_sample(flag: str) -> list[str]:
    action = run_parser()._option_string_actions.get(flag)
    takes_value = action is not None and action.nargs != 0
    return [flag, "1"] if takes_value else [flag]


def run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_run_flags(parser)
    return parser


BASE = ["--model-path", "/tmp", "--compiled-model-path", "/tmp", "--prompt", "hi"]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args([*HEAD, *BASE, *argv])


def outcome(flag: str, json_file: Path) -> str:
    """ "accepted" (parsed, and its settings built), or the usage error it gave."""
    try:
        args = build_parser().parse_args([*HEAD, *BASE, *sample_argv(flag, json_file)])
    except UsageError as exc:
        return str(exc)
    neuron_config_options(args)
    return "accepted"


@pytest.mark.filterwarnings("ignore:--logical-neuron-cores is deprecated")
def test_every_flag_is_accepted_or_refused_in_one_line(json_file) -> None:
    assert len(NXDI_FLAGS) == len(set(NXDI_FLAGS)) == 150
    outcomes = {flag: outcome(flag, json_file) for flag in NXDI_FLAGS}
    refused = {flag for flag, result in outcomes.items() if result != "accepted"}
    assert refused == REFUSED, {flag: outcomes[flag] for flag in refused ^ REFUSED}
    for flag in refused:
        message = outcomes[flag]
        assert f"argument {flag}" in message and "not supported by nxdplug" in message
        assert "\n" not in message
    accepted = len(NXDI_FLAGS) - len(refused)
    assert accepted / len(NXDI_FLAGS) >= 0.9, f"{accepted} of {len(NXDI_FLAGS)} accepted"


def test_a_flag_named_after_an_attribute_sets_it(json_file) -> None:
    attribute_names = {flag for flag, _ in attribute_flags()}
    checked = 0
    for flag in NXDI_FLAGS:
        if flag not in attribute_names or flag in REFUSED:
            continue
        args = parse(*sample_argv(flag, json_file))
        attribute = flag.lstrip("-").replace("-", "_")
        options = neuron_config_options(args)
        assert options[attribute] == getattr(args, attribute), flag
        # A valid keyword of the config class (as-declared lets --attention-dtype differ).
        MoENeuronConfig(**{"cast_type": "as-declared"} | options)
        checked += 1
    assert checked >= 50


def test_flags_mean_what_they_mean_in_inference_demo(json_file) -> None:
    defaults = parse()
    assert defaults.check_accuracy_mode == "skip"  # skip-accuracy-check
    assert (defaults.top_k, defaults.top_p, defaults.temperature) == (1, 1.0, 1.0)
    assert defaults.do_sample is False and defaults.pad_token_id == 0
    assert defaults.divergence_difference_tol == 0.001
    assert defaults.benchmark_report_path == "./benchmark_report.json"
    assert (defaults.max_loras, defaults.max_lora_rank) == (1, 16)
    assert neuron_config_options(defaults) == {"batch_size": 1}  # NeuronConfig's defaults

    options = neuron_config_options(
        parse(
            "--tp-degree", "2", "--enable-bucketing", "--context-encoding-buckets", "4", "8",
            "--attn-kernel-enabled", "--logical-nc-config", "2", "--router-act-fn", "sigmoid",
            "--disable-normalize-top-k-affinities", "--modules-to-not-convert-file",
            str(json_file), "--batch-size", "2",
        )
    )  # fmt: skip
    config = MoENeuronConfig(**options)
    assert config.tp_degree == 2 and config.batch_size == 2
    assert config.enable_bucketing and config.context_encoding_buckets == [4, 8]
    assert config.attn_kernel_enabled and config.logical_nc_config == 2
    assert config.router_config.act_fn == "sigmoid"
    assert config.normalize_top_k_affinities is False
    assert config.modules_to_not_convert == ["lm_head"]

    sampling = neuron_config_options(
        parse("--on-device-sampling", "--top-k", "5", "--do-sample", "--global-topk", "64")
    )["on_device_sampling_config"]
    assert sampling == OnDeviceSamplingConfig(do_sample=True, top_k=5, global_topk=64)

    lora = neuron_config_options(
        parse("--enable-lora", "--max-loras", "2", "--lora-ckpt-path", "a : /x/a",
              "--lora-ckpt-path", "b:/x/b", "--adapter-id", "a")
    )["lora_config"]  # fmt: skip
    assert lora.lora_ckpt_paths == {"a": "/x/a", "b": "/x/b"} and lora.max_loras == 2

    blocks = neuron_config_options(
        parse("--enable-block-kv-layout", "--pa-num-blocks", "40", "--pa-block-size", "16",
              "--enable-prefix-caching", "--enable-chunked-prefill", "--max-num-seqs", "4",
              "--prefix-buckets", "16", "32")
    )  # fmt: skip
    assert blocks == {
        "batch_size": 1,
        "is_block_kv_layout": True,
        "pa_num_blocks": 40,
        "pa_block_size": 16,
        "is_prefix_caching": True,
        "is_chunked_prefill": True,
        "max_batch_size": 4,
        "prefix_buckets": [16, 32],
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cp-degree", "2"], "argument --cp-degree: only 1 is supported"),
        (["--check-accuracy-mode", "draft-logit-matching"], "draft-logit-matching is not"),
        (["--k-quant-method", "per_channel_symmetric"], "argument --k-quant-method: only"),
        (["--windowed-context-encoding-size", "8"], "--windowed-context-encoding-size: not"),
    ],
)
def test_a_refused_flag_or_value_exits_2_with_one_line(capsys, argv, message) -> None:
    code = main([*HEAD, *BASE, *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("nxdplug: error: ") and message in err


def test_a_refused_flag_from_the_command_line_has_no_traceback(tiny_checkpoint) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "nxdplug.nxdi.inference_demo", "--model-type", "llama",
         "--task-type", "causal-lm", "run", "--model-path", str(tiny_checkpoint("llama")),
         "--compiled-model-path", "/tmp/unused", "--prompt", "hi", "--apply-seq-ids-mask"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "nxdplug: error: argument --apply-seq-ids-mask: not supported by nxdplug: masking "
        "KV-cache updates by seq_ids is not implemented (see 'nxdplug inference_demo run --help')"
    ]


def test_the_entry_points_are_the_command() -> None:
    import nxdplug.nxdi.inference_demo as nxdi_module

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["inference_demo"] == "nxdplug.nxdi.demo.command:console_main"
    assert nxdi_module.main is inference_demo_main


def test_values_for_another_setup_are_refused(capsys, tiny_checkpoint) -> None:
    checkpoint = str(tiny_checkpoint("llama"))
    argv = ["--model-path", checkpoint, "--compiled-model-path", "/tmp/unused", "--prompt", "hi"]
    for extra, message in (
        (["--world-size", "2"], "--world-size 2 is not supported: only 1"),
        (["--draft-model-tp-degree", "4"], "--draft-model-tp-degree 4 is not supported"),
    ):
        assert main([*HEAD, *argv, *extra]) == 2
        assert message in capsys.readouterr().err
    wrong_family = [*HEAD[:2], "qwen2", *HEAD[3:], *argv]
    assert main(wrong_family) == 2
    assert "--model-type qwen2: " in capsys.readouterr().err


def test_shift_right_moves_each_row_behind_padding() -> None:
    ids, mask = torch.tensor([[5, 6], [7, 0]]), torch.tensor([[1, 1], [1, 0]])
    shifted, shifted_mask = shift_right(ids, mask, [1, 2], pad_id=9)
    assert shifted.tolist() == [[9, 5, 6, 9], [9, 9, 7, 0]]
    assert shifted_mask.tolist() == [[0, 1, 1, 0], [0, 0, 1, 0]]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", seed=3, initializer_range=0.15)


def demo_argv(checkpoint: Path, compiled: Path, *extra: str) -> list[str]:
    return [
        *HEAD, "--model-path", str(checkpoint), "--compiled-model-path", str(compiled),
        "--prompt", "hello world", "--prompt", "the cat", "--seq-len", "24",
        "--max-context-length", "12", "--torch-dtype", "float32", "--quiet", *extra,
    ]  # fmt: skip


def test_on_cpu_checks_logits_generates_captures_and_benchmarks(
    capsys, checkpoint, tmp_path
) -> None:
    report = tmp_path / "report.json"
    code = main(
        demo_argv(
            checkpoint, tmp_path / "unused", "--on-cpu", "--check-accuracy-mode",
            "logit-matching", "--vocab-parallel", "--k-cache-transposed", "--capture-indices",
            "0", "2", "--input-capture-save-dir", str(tmp_path / "inputs"), "--benchmark",
            "--benchmark-report-path", str(report),
        )
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "logit matching: PASS" in out
    assert [line for line in out.splitlines() if line.startswith("Output ")][1].startswith(
        "Output 1: the cat"
    )
    assert err.count("no effect on this backend") == 1 and "--k-cache-transposed" in err
    assert sorted(p.name for p in (tmp_path / "inputs").iterdir()) == [
        "saved_inputs_cte_0.pt",
        "saved_inputs_tkg_2.pt",
    ]
    assert set(json.loads(report.read_text())) >= {"e2e_model", "token_generation_model"}


def test_the_block_layout_checks_tokens_against_hf(capsys, checkpoint, tmp_path) -> None:
    argv = demo_argv(
        checkpoint, tmp_path / "unused", "--on-cpu", "--enable-block-kv-layout",
        "--pa-block-size", "8", "--batch-size", "2", "--check-accuracy-mode", "token-matching",
    )  # fmt: skip
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "token matching: PASS" in out


def test_input_start_offsets_do_not_change_the_outputs(capsys, checkpoint, tmp_path) -> None:
    outputs = []
    for extra in ([], ["--input-start-offsets", "3"]):
        assert main(demo_argv(checkpoint, tmp_path, "--on-cpu", *extra)) == 0
        out = capsys.readouterr().out
        outputs.append([line for line in out.splitlines() if line.startswith("Output ")])
    # The same text, up to max_length, which the padding before each prompt counts in.
    assert len(outputs[1]) == 2
    for plain, shifted in zip(outputs[0], outputs[1], strict=True):
        assert plain.startswith(shifted) and len(shifted) > len("Output 1: the cat")


def test_compile_dry_run_compiles_nothing(capsys, checkpoint, tmp_path) -> None:
    assert main(demo_argv(checkpoint, tmp_path / "c", "--compile-dry-run")) == 0
    assert "no problems found" in capsys.readouterr().out
    assert not (tmp_path / "c").exists()


def run_demo(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nxdplug.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"HF_HUB_OFFLINE": "1"},
    )


def test_compile_only_then_skip_compile_loads_checks_and_generates(checkpoint, tmp_path) -> None:
    compiled = tmp_path / "compiled"
    done = run_demo(*demo_argv(checkpoint, compiled, "--compile-only"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Compiling and tracing time" in done.stdout and "Output" not in done.stdout
    assert (compiled / "manifest.json").is_file()

    done = run_demo(
        *demo_argv(
            checkpoint, compiled, "--skip-compile", "--check-accuracy-mode", "token-matching"
        )
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Skipping model compilation" in done.stdout
    assert "token matching: PASS" in done.stdout
    outputs = [line for line in done.stdout.splitlines() if line.startswith("Output ")]
    assert outputs[0].startswith("Output 0: hello world") and len(outputs) == 2
    assert len(outputs[0]) > len("Output 0: hello world")
    assert (compiled / "tokenizer_config.json").is_file()  # saved beside the model, as NxDI


def test_the_quantize_clamp_bound_default_is_infinite() -> None:
    assert parse().quantize_clamp_bound == math.inf


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--global-topk", "5"], "--global-topk need(s) --on-device-sampling"),
        (["--adapter-id", "a"], "--adapter-id need(s) --enable-lora"),
        (["--no-kv-direct-cast"], "--no-kv-direct-cast is not supported"),
    ],
)
def test_a_feature_flag_without_its_feature_is_an_error(
    capsys, tiny_checkpoint, argv, message
) -> None:
    paths = ["--model-path", str(tiny_checkpoint("llama")), "--compiled-model-path", "/tmp/x"]
    assert main([*HEAD, *paths, "--prompt", "hi", *argv]) == 1
    assert message in capsys.readouterr().err
