"""The examples run, and a ported NxD Inference script prints what HF transformers generates."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from tests import REPO_ROOT
from tests.fresh_process import needs_avx512_bf16

EXAMPLES = REPO_ROOT / "examples"


def test_nxdi_generate_script_prints_hf_greedy_text(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama", seed=5)
    prompts = ["def fibonacci(n):", "import os"]
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "nxdi_generate.py"), str(path), *prompts],
        capture_output=True,
        text=True,
        check=True,
    )
    printed = result.stdout.split("Generated outputs:\n", 1)[1].splitlines()

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    inputs = tokenizer(prompts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        expected = hf.generate(
            **inputs, generation_config=GenerationConfig.from_pretrained(path), max_length=128
        )
    texts = tokenizer.batch_decode(
        expected, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    expected_lines = "\n".join(f"Output {i}: {t}" for i, t in enumerate(texts)).splitlines()
    assert printed == expected_lines


def test_nxdi_quantize_script_runs(tiny_checkpoint, tmp_path) -> None:
    path = tiny_checkpoint("llama", seed=5)
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "nxdi_quantize.py"), str(path), str(tmp_path / "q")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "MiB held, against" in result.stdout
    assert (tmp_path / "q" / "model.safetensors").is_file()


def test_nxdi_speculative_script_prints_hf_greedy_text(tiny_checkpoint) -> None:
    target = tiny_checkpoint("llama", seed=5)
    draft = tiny_checkpoint("llama", seed=5, num_hidden_layers=1)
    prompt = "def fibonacci(n):"
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "nxdi_speculative.py"), str(target), str(draft), prompt],
        capture_output=True,
        text=True,
        check=True,
    )
    printed = result.stdout.split("Generated outputs:\n", 1)[1]

    tokenizer = AutoTokenizer.from_pretrained(target)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf.generate(
            **tokenizer([prompt], return_tensors="pt"),
            generation_config=GenerationConfig.from_pretrained(target),
        )
    text = tokenizer.decode(
        expected[0], skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    assert printed.startswith(f"Output 0: {text}\nspeculation: "), printed


def test_engine_async_mode_example_times_both_modes(tiny_checkpoint) -> None:
    """Eager here: the compiled engine in async mode is tested in test_engine.py."""
    path = tiny_checkpoint("llama", seed=5)
    command = [sys.executable, str(EXAMPLES / "engine_async_mode.py"), "--model-path", str(path)]
    command += ["--torch-dtype", "float32", "--batch-size", "2", "--prompt-length", "8"]
    command += ["--max-tokens", "8", "--runs", "1"]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    assert "async_mode=False" in result.stdout and "async_mode=True" in result.stdout
    assert "gain" in result.stdout


def test_engine_throughput_example_serves_every_request(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama", seed=5)
    command = [sys.executable, str(EXAMPLES / "engine_throughput.py"), "--model-path", str(path)]
    command += ["--torch-dtype", "float32", "--batch-size", "2", "--requests", "5", "--runs", "1"]
    command += ["--prompt-length", "4", "--max-tokens", "3", "--seq-len", "32"]
    command += ["--max-context-length", "8", "--neuron-config", "is_block_kv_layout=true"]
    command += ["--neuron-config", "pa_block_size=8"]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    assert re.fullmatch(
        r"5 requests, 2 at a time: [\d.]+ s, [\d.]+ output tok/s, \d+ steps, "
        r"median step [\d.]+ ms\n",
        result.stdout,
    ), result.stdout


def test_nxdi_generation_demo_compiles_reloads_and_prints_hf_greedy_text(tiny_checkpoint, tmp_path):
    """NxD Inference's generation demo through nxdplug.nxdi: compile, rebuild the application
    from the compiled folder alone, load, generate with on-device sampling (top_k 1) and the
    per-row sampling_params it passes (unused by a greedy model, as in NxD Inference: warned),
    tp_degree=32 in one process (the head layout only)."""
    path = tiny_checkpoint("llama", seed=5)
    traced = tmp_path / "traced"
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "nxdi_generation_demo.py"), str(path), str(traced)],
        capture_output=True,
        text=True,
        check=True,
    )
    printed = result.stdout.split("Generated outputs:\n", 1)[1]
    assert "sampling_params are not used" in result.stderr
    assert (traced / "neuron_config.json").is_file() and (traced / "tokenizer.json").is_file()

    prompts = ["def fibonacci(n):", "import os"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = [tokenizer(prompt, return_tensors="pt").input_ids for prompt in prompts]
    # max_length=seq_len (64) counts the right-padded batch: every row gets 64 - longest prompt.
    new_tokens = 64 - max(row.shape[1] for row in rows)
    expected = []
    with torch.inference_mode():
        for index, row in enumerate(rows):
            tokens = hf.generate(row, do_sample=False, max_new_tokens=new_tokens, eos_token_id=None)
            assert len(set(tokens[0, row.shape[1] :].tolist())) > 5  # not one token over and over
            text = tokenizer.decode(
                tokens[0], skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
            expected.append(f"Output {index}: {text}\n")
    assert printed == "".join(expected)


def test_decode_attention_example_times_both_attentions(tiny_checkpoint) -> None:
    """Eager, float32: the kernel and the gathered lines decode the same greedy tokens."""
    path = tiny_checkpoint("llama", seed=5)
    command = [sys.executable, str(EXAMPLES / "decode_attention.py"), "--model-path", str(path)]
    command += ["--torch-dtype", "float32", "--batch-size", "3", "--prompt-length", "8"]
    command += ["--seq-len", "64", "--steps", "20", "--rounds", "2"]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    assert re.fullmatch(
        r"gather  median decode step [\d.]+ ms\nkernel  median decode step [\d.]+ ms\n"
        r"kernel / gather: x[\d.]+; same greedy tokens: True\n",
        result.stdout,
    ), result.stdout


@needs_avx512_bf16
def test_bf16_linear_example_times_onednn_and_panels() -> None:
    command = [sys.executable, str(EXAMPLES / "bf16_linear.py"), "--rows", "1", "9"]
    command += ["--hidden-size", "64", "--intermediate-size", "96", "--heads", "4"]
    command += ["--kv-heads", "2", "--layers", "2", "--vocab-size", "100", "--passes", "2"]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    line = r" +{} rows: oneDNN [\d.]+ ms \(\d+ GFLOP/s\), panels [\d.]+ ms \(\d+ GFLOP/s\); "
    line += r"panels x[\d.]+ faster\n"
    assert re.fullmatch(line.format(1) + line.format(9), result.stdout), result.stdout


@needs_avx512_bf16
def test_int4_rows_bound_example_times_both_kernels_both_ways() -> None:
    command = [sys.executable, str(EXAMPLES / "int4_rows_bound.py"), "--rows", "1", "9"]
    command += ["--layers", "1", "--passes", "2"]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    line = r" +{} rows, {} *: bf16 +[\d.]+ ms +[\d.]+ GMAC/s; int4 +[\d.]+ ms +[\d.]+ GMAC/s; "
    line += r"int4 / bf16 [\d.]+\n"
    expected = "".join(line.format(r, w) for r in (1, 9) for w in ("streamed", "hot"))
    assert re.fullmatch(expected, result.stdout), result.stdout


def test_served_perplexity_is_hf_perplexity(tiny_checkpoint, tmp_path: Path) -> None:
    """The lm-evaluation-harness way (echo + logprobs through a running ``nxdplug serve``)
    gives the perplexity HF transformers computes on the same token ids."""
    from tests.plugins.serve.test_serving import MODEL, start_server, stop

    path = tiny_checkpoint("llama", seed=5, initializer_range=0.15)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (9, 14, 5)]
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    options = ("--enable-prompt-logprobs", "--seq-len", "32", "--batch-size", "2")
    process, base = start_server(path, *options)
    try:
        result = subprocess.run(
            [
                sys.executable, str(EXAMPLES / "served_perplexity.py"), "--base-url",
                f"{base}/v1", "--model", MODEL, "--prompts", str(prompt_file),
            ],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    finally:
        stop([process])
    served = float(re.search(r"served: 25 tokens, perplexity ([\d.]+)", result.stdout).group(1))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    nll = []
    with torch.inference_mode():
        for prompt in prompts:
            logprobs = hf(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
            nll += (-logprobs.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]).tolist()
    assert served == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-4)


def test_quantization_perplexity_script_scores_as_hf(tiny_checkpoint, tmp_path) -> None:
    """Its float32 perplexity is HF's over the same windows; each method gets a line."""
    path = tiny_checkpoint("llama", seed=5)
    library = REPO_ROOT / "examples"
    (tmp_path / "heldout.txt").write_text("nxdi_generate.py\n")
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "quantization_perplexity.py"),
            "--model-path",
            str(path),
            "--heldout",
            str(tmp_path / "heldout.txt"),
            "--library",
            str(library),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = dict(re.findall(r"^(.+?)\s+perplexity\s+([\d.]+)", result.stdout, re.MULTILINE))
    assert list(lines) == [
        "float32",
        "int8 per channel",
        "int4 blocks of 128",
        "int4 blocks of 32",
        "int4 per channel",
    ]
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer((library / "nxdi_generate.py").read_text(), add_special_tokens=False)
    tokens = torch.tensor(ids.input_ids)
    count = (len(tokens) - 1) // 256
    assert count >= 2
    windows = torch.stack([tokens[i * 256 : (i + 1) * 256 + 1] for i in range(count)])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(windows[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
    assert float(lines["float32"]) == pytest.approx(math.exp(loss.item()), rel=1e-4)


def test_llama_cpp_comparison_times_nxdplug_and_says_what_it_could_not(
    tiny_checkpoint, tmp_path
) -> None:
    """The comparison script (llama.cpp is timed where llama-cpp-python is installed; CI has it
    not, and the script must say so and time nxdplug alone)."""
    path = tiny_checkpoint("llama", seed=5)
    command = [sys.executable, str(EXAMPLES / "compare_llama_cpp.py"), "--model-path", str(path)]
    command += ["--work-dir", str(tmp_path), "--modes", "int8", "--rounds", "1", "--json"]
    command += ["--prompt-length", "8", "--max-new-tokens", "4", "--eager"]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["read_bandwidth_gb_s"] > 0
    assert report["systems"]["nxdplug int8"]["decode_tokens_per_s"] > 0
    timed_llama_cpp = "llama.cpp q8_0" in report["systems"]
    assert timed_llama_cpp or "llama.cpp not timed" in result.stdout


def test_code_edit_prompts_repeat_each_files_start(tmp_path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "a.py").write_text("".join(f"line_{i} = {i}\n" for i in range(20)))
    (source / "short.py").write_text("x = 1\n")
    output = tmp_path / "edit.jsonl"
    command = [sys.executable, str(EXAMPLES / "code_edit_prompts.py"), "--output", str(output)]
    command += ["--source", str(source), "--count", "1", "--lines", "4", "--restart", "2"]
    subprocess.run(command, capture_output=True, text=True, check=True)
    start = "line_0 = 0\nline_1 = 1\n"
    expected = start + "line_2 = 2\nline_3 = 3\n\n" + start
    assert [json.loads(line) for line in output.read_text().splitlines()] == [{"prompt": expected}]
    command[command.index("--count") + 1] = "2"
    refused = subprocess.run(command, capture_output=True, text=True)
    assert refused.returncode == 2 and "has only 1 .py files long enough" in refused.stderr


def test_speculation_cost_model_prints_each_methods_break_even(tmp_path) -> None:
    """Eager on pycoder-tiny's shape: the table row and a break-even line per method."""
    command = [sys.executable, str(EXAMPLES / "speculation_cost_model.py")]
    command += ["--work-dir", str(tmp_path), "--sizes", "pycoder-tiny", "--eager", "--calls", "2"]
    command += ["--tokens-per-verification", '{"ngram": 3.0, "eagle": 0.5}']
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"pycoder-draft decode call: [\d.]+ ms", lines[0]), result.stdout
    row = r"\| pycoder-tiny \| 5M \| [\d.]+ \| [\d.]+ \| [\d.]+ / x[\d.]+ \| [\d.]+ / x[\d.]+ \|"
    assert any(re.fullmatch(row, line) for line in lines), result.stdout
    # Half a token a verification never pays; the lookup costs next to nothing.
    assert lines[-2] == "ngram: breaks even already at 5.4M", result.stdout
    assert lines[-1] == "eagle: breaks even not by 5M", result.stdout


def test_speculation_cost_model_interpolates_the_break_even() -> None:
    spec = importlib.util.spec_from_file_location("cost", EXAMPLES / "speculation_cost_model.py")
    cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cost)
    # Gains 0.5 at 10M and 1.5 at 1000M: halfway in log size, 100M.
    assert cost.break_even([(10e6, 0.5), (1000e6, 1.5)]) == "~100M"
    assert cost.break_even([(10e6, 1.2), (1000e6, 1.5)]) == "already at 10.0M"
    assert cost.break_even([(10e6, 0.2), (1000e6, 0.9)]) == "not by 1000M"
