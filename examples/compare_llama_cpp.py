"""nxdplug beside llama.cpp on the same weights: decode speed and time to first token, in one
process, the systems taking turns run by run so that load from other processes falls on all.

    pip install llama-cpp-python gguf sentencepiece   # builds llama.cpp (~13 min on 2 cores)
    python examples/compare_llama_cpp.py --model-path /tmp/llama-120m --work-dir /tmp/lcmp

- llama.cpp's own converter (``convert_hf_to_gguf.py``, in llama-cpp-python's source
  distribution: fetched with ``pip download`` unless ``--converter`` names it) writes the
  checkpoint as bf16 GGUF, and llama.cpp's quantizer (through llama-cpp-python) makes q8_0,
  q4_0 and q4_K_M (the 4-bit file most of its users download) from it. A tokenizer llama.cpp
  does not know is written with GPT-2's pre-tokenizer: the benchmark feeds token ids, so only
  the vocabulary's metadata is affected.
- nxdplug runs bf16, int8 per channel and int4 in blocks of 32 input features (q4_0's block),
  compiled with inductor (eagerly with ``--eager``), in folders kept under ``--work-dir``.
- Printed per pair (bf16 / bf16, int8 / q8_0, int4 / q4_0 and q4_K_M): median decode tok/s and
  TTFT, the ratios, and each system's fraction of the bandwidth ceiling (the bytes a decode step
  reads, weights and KV cache, over the machine's measured read bandwidth).

Where llama-cpp-python is missing or the conversion fails, it says why and times nxdplug alone.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nxdplug import NeuronConfig, from_pretrained
from nxdplug.plugins.benchmark.measurements import (
    GenerationStats,
    RunTimes,
    decode_bytes_per_step,
    kv_cache_bytes,
    mean_decode_positions,
    measure_nxdplug,
    measure_read_bandwidth,
    random_prompt_ids,
)

NXDPLUG_MODES = {
    "bf16": {},
    "int8": {"quantization_dtype": "int8", "quantization_type": "per_channel_symmetric"},
    "int4": {
        "quantization_dtype": "int4",
        "quantization_type": "blockwise_symmetric",
        "quantization_block_size": 32,
    },
}
# paired with nxdplug's modes (None: the bf16 file as converted)
LLAMA_CPP_TYPES = {"bf16": (None,), "int8": ("Q8_0",), "int4": ("Q4_0", "Q4_K_M")}
CONVERTER = "vendor/llama.cpp/convert_hf_to_gguf.py"
# Runs llama.cpp's converter with an unknown BPE pre-tokenizer taken as GPT-2's.
CONVERT = """
import runpy, sys
converter = sys.argv[1]
sys.path.insert(0, converter.rsplit("/", 1)[0])
from conversion import base
recognized = base.TextModel.get_vocab_base_pre
def pre_tokenizer(self, tokenizer):
    try:
        return recognized(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre_tokenizer
sys.argv = sys.argv[1:]
runpy.run_path(converter, run_name="__main__")
"""


@dataclass
class System:
    name: str
    run: Any  # () -> RunTimes
    step_bytes: float
    runs: list[RunTimes]


def nxdplug_system(
    args: argparse.Namespace, mode: str, input_ids: torch.Tensor
) -> tuple[System, Any]:
    """nxdplug in ``mode``, quantized and compiled into ``--work-dir`` once; and its config."""
    options = {
        "torch_dtype": "bfloat16",
        "batch_size": 1,
        "max_context_length": args.prompt_length,
        "seq_len": args.prompt_length + args.max_new_tokens,
        "compile_backend": "inductor",
        **NXDPLUG_MODES[mode],
    }
    if mode != "bf16":
        options |= {"quantized": True, "quantized_checkpoints_path": str(args.work_dir / mode)}
    config = NeuronConfig(**options)
    app = from_pretrained(args.model_path, config)
    if mode != "bf16" and not (args.work_dir / mode).exists():
        type(app).save_quantized_state_dict(args.model_path, app.config)
    compiled = args.work_dir / f"compiled-{mode}"
    if args.eager:
        app.to_cpu()
    else:
        if not compiled.exists():
            app.compile(compiled, quiet=True)
            app = from_pretrained(args.model_path, config)
        app.load(compiled, quiet=True)
    positions = mean_decode_positions(args.prompt_length, args.max_new_tokens)
    step_bytes = decode_bytes_per_step(app, 1, positions).total

    def run() -> RunTimes:
        return measure_nxdplug(app, input_ids, args.max_new_tokens, runs=1, warmup=0)[0]

    return System(f"nxdplug {mode}", run, step_bytes, []), app.config


def llama_cpp_systems(args: argparse.Namespace, config: Any, prompt: list[int]) -> list[System]:
    """llama.cpp's bf16, q8_0, q4_0 and q4_K_M, or none (and why) where it cannot run here."""
    try:
        import gguf
        import llama_cpp
        import numpy as np
    except ImportError as exc:
        print(f"llama.cpp not timed: {exc} (pip install llama-cpp-python gguf sentencepiece)")
        return []
    bf16 = args.work_dir / "model-bf16.gguf"
    if not bf16.exists():
        converter = args.converter or fetch_converter(args.work_dir, llama_cpp.__version__)
        command = [sys.executable, "-c", CONVERT, str(converter), str(args.model_path)]
        command += ["--outtype", "bf16", "--outfile", str(bf16)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"llama.cpp not timed: its converter failed:\n{done.stderr[-2000:]}")
            return []
    positions = mean_decode_positions(args.prompt_length, args.max_new_tokens)
    kv = kv_cache_bytes(config, 1, positions)  # llama.cpp's f16 cache: bf16's size
    systems = []
    for mode, ftypes in LLAMA_CPP_TYPES.items():
        if mode not in args.modes:
            continue
        for ftype in ftypes:
            system = llama_cpp_system(args, llama_cpp, np, gguf, bf16, ftype, prompt, kv)
            if system is not None:
                systems.append(system)
    return systems


def llama_cpp_system(
    args: argparse.Namespace,
    llama_cpp: Any,
    np: Any,
    gguf: Any,
    bf16: Path,
    ftype: str | None,
    prompt: list[int],
    kv: int,
) -> System | None:
    """llama.cpp on the bf16 file, or on it quantized to ``ftype`` (made once); None, after
    saying why, where its quantizer fails."""
    path = bf16 if ftype is None else args.work_dir / f"model-{ftype.lower()}.gguf"
    if not path.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
        params.nthread = args.threads
        status = llama_cpp.llama_model_quantize(
            str(bf16).encode(), str(path).encode(), ctypes.byref(params)
        )
        if status != 0:
            print(f"llama.cpp {ftype} not timed: its quantizer returned {status}")
            return None
    llm = llama_cpp.Llama(
        str(path),
        n_ctx=args.prompt_length + args.max_new_tokens,
        n_batch=args.prompt_length,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    return System(
        f"llama.cpp {(ftype or 'bf16').lower()}",
        lambda: llama_cpp_run(llm, llama_cpp, np, prompt, args.max_new_tokens),
        step_bytes(gguf.GGUFReader(str(path))) + kv,
        [],
    )


def fetch_converter(work_dir: Path, version: str) -> Path:
    """llama.cpp's converter, from llama-cpp-python's source distribution (downloaded once)."""
    folder = work_dir / "llama-cpp-python-src"
    if not folder.exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={version}",
                "-d",
                str(folder),
            ],
            check=True,
        )
        (archive,) = folder.glob("*.tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(folder, filter="data")
    (converter,) = folder.glob(f"*/{CONVERTER}")
    return converter


def step_bytes(reader: Any) -> int:
    """The GGUF weight bytes a decode step reads: all but the token embedding table, of which
    one row is read (unless it is also the output projection)."""
    sizes = {tensor.name: int(tensor.n_bytes) for tensor in reader.tensors}
    embedding = "token_embd.weight"
    tied = "output.weight" not in sizes
    return sum(sizes.values()) - (0 if tied else sizes[embedding])


def llama_cpp_run(llm: Any, llama_cpp: Any, np: Any, prompt: list[int], new: int) -> RunTimes:
    """Greedy decoding of ``new`` tokens after ``prompt``, timed as nxdplug's runs are."""

    def greedy() -> int:
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),))))

    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    token = greedy()
    stamps = [time.perf_counter()]
    for _ in range(new - 1):
        llm.eval([token])
        token = greedy()
        stamps.append(time.perf_counter())
    return RunTimes(start=start, tokens=tuple(stamps), end=stamps[-1])


def report(systems: list[System], bandwidth: float) -> dict[str, dict[str, float]]:
    results = {}
    for system in systems:
        stats = GenerationStats.from_runs(system.runs, batch_size=1)
        seconds = stats.per_token.p50
        results[system.name] = {
            "ttft_ms": stats.ttft * 1e3,
            "decode_tokens_per_s": stats.decode_tokens_per_s,
            "of_bandwidth_ceiling": system.step_bytes / seconds / (bandwidth * 1e9),
        }
    return results


def print_table(results: dict[str, dict[str, float]], bandwidth: float) -> None:
    print(f"read bandwidth {bandwidth:.1f} GB/s")
    print(f"{'system':18} {'TTFT ms':>9} {'decode tok/s':>13} {'of ceiling':>11}")
    for name, row in results.items():
        print(
            f"{name:18} {row['ttft_ms']:9.1f} {row['decode_tokens_per_s']:13.1f} "
            f"{row['of_bandwidth_ceiling']:10.0%}"
        )
    bf16 = results.get("nxdplug bf16")
    for mode, ftypes in LLAMA_CPP_TYPES.items():
        ours = results.get(f"nxdplug {mode}")
        for ftype in ftypes:
            name = (ftype or "bf16").lower()
            theirs = results.get(f"llama.cpp {name}")
            if ours and theirs:
                print(
                    f"nxdplug {mode} / llama.cpp {name}: decode "
                    f"{ours['decode_tokens_per_s'] / theirs['decode_tokens_per_s']:.2f}x, TTFT "
                    f"{ours['ttft_ms'] / theirs['ttft_ms']:.2f}x"
                )
        if ours and bf16 and mode != "bf16":
            print(
                f"nxdplug {mode} / nxdplug bf16: decode "
                f"{ours['decode_tokens_per_s'] / bf16['decode_tokens_per_s']:.2f}x, TTFT "
                f"{ours['ttft_ms'] / bf16['ttft_ms']:.2f}x"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, required=True, help="kept between runs")
    parser.add_argument("--converter", type=Path, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument(
        "--modes", nargs="+", choices=tuple(NXDPLUG_MODES), default=list(NXDPLUG_MODES)
    )
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="timed runs of each system")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--eager", action="store_true", help="run nxdplug eagerly instead of compiled (slower)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)

    vocab = json.loads((args.model_path / "config.json").read_text())["vocab_size"]
    input_ids = random_prompt_ids(vocab, 1, args.prompt_length)
    systems, config = [], None
    for mode in args.modes:
        system, config = nxdplug_system(args, mode, input_ids)
        systems.append(system)
    systems += llama_cpp_systems(args, config, input_ids[0].tolist())
    for system in systems:  # warm-up
        system.run()
    for _ in range(args.rounds):
        for system in systems:
            system.runs.append(system.run())
    bandwidth = measure_read_bandwidth()
    results = report(systems, bandwidth)
    if args.json:
        print(json.dumps({"read_bandwidth_gb_s": bandwidth, "systems": results}))
    else:
        print_table(results, bandwidth)


if __name__ == "__main__":
    main()
