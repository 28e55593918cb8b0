"""``nxdplug benchmark``: latency and throughput of greedy generation, like NxD Inference's.

Random prompts of a fixed length, exactly ``--max-new-tokens`` new tokens per run (no stop on
end-of-sequence), timed per phase; optionally HF transformers on the same prompts in the same
process, eager and/or with a static KV cache and torch.compile; the base model (the same
config without the settings that the command line's feature options made) when those options
enable a feature plugin; and always the
memory-bandwidth ceiling of decoding and the compute ceiling of prefill on this machine. The
measuring itself is in :mod:`nxdplug.plugins.benchmark.measurements` and
:mod:`nxdplug.plugins.benchmark.roofline`.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nxdplug.plugin_api import (
    NxdPlugError,
    add_compiled_model_options,
    add_extension_arguments,
    add_neuron_config_options,
    add_speculation_options,
    application_beside,
    enabling_settings,
    generate_keywords,
    hf_comparison,
    inference_config,
    load_model,
    neuron_config_kwargs,
    plain_application,
    positive_int,
    prepare_config,
    refuse_unused_draft,
)

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, NeuronBaseForCausalLM, NeuronConfig

# --compare-hf's modes, in the report's order, and each one's name in the report.
HF_SYSTEMS = {"eager": "hf", "compiled": "hf_compiled"}
# The base model's compiled folder: --compiled-model-path's name plus this.
BASE_SUFFIX = "-base"
BASE_HELP = (
    "When this command's feature-plugin options enable a feature (adapters, ...), the base "
    "model is timed in turn too: the same checkpoint and NeuronConfig with the settings those "
    "options made back at their defaults, eager or, with --compiled-model-path DIR, compiled "
    f"into DIR{BASE_SUFFIX}; the report gives its figures and nxdplug/base."
)


def add_benchmark_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-path", required=True, type=Path, metavar="DIR", help="an HF checkpoint folder"
    )
    parser.add_argument("--prompt-length", type=positive_int, default=128, metavar="N")
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=128,
        metavar="N",
        help="tokens generated per run, exactly (at least 2: the first comes from context "
        "encoding)",
    )
    parser.add_argument(
        "--runs", type=positive_int, default=5, metavar="N", help="timed runs, after 1 warm-up"
    )
    parser.add_argument(
        "--compare-hf",
        nargs="*",
        choices=tuple(HF_SYSTEMS),
        default=None,
        metavar="MODE",
        help="also time HF transformers' generate() on the same prompts and print the ratios: "
        "'eager', and 'compiled' (a static KV cache and torch.compile'd forward, compiled in "
        "its warm-up); both when no mode is given",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument(
        "--prompt-file",
        type=Path,
        default=None,
        metavar="JSONL",
        help="prompts as JSON lines with an input_ids list each (the first --batch-size "
        "entries, cut to --prompt-length); default: random token ids",
    )
    parser.add_argument(
        "--prompt-lookup-num-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --speculation-length: speculate by n-gram lookup instead of a draft model",
    )
    add_compiled_model_options(parser, required=False)
    add_speculation_options(parser)
    add_neuron_config_options(parser)
    add_extension_arguments(parser, "benchmark")
    parser.epilog = BASE_HELP


def benchmark_options(args: argparse.Namespace) -> dict[str, Any]:
    """The NeuronConfig options: the user's, with lengths that fit the benchmark by default."""
    if args.max_new_tokens < 2:
        raise NxdPlugError(
            "--max-new-tokens must be at least 2: the first token comes from context encoding, "
            "so token generation is timed from the second on"
        )
    options = neuron_config_kwargs(args)
    # The prompt's own width: max_context_length would otherwise follow seq_len, and the
    # context-encoding graph pad the prompt to it (twice the work for --prompt-length 512
    # --seq-len 1024), unless buckets are asked for.
    bucketed = options.get("enable_bucketing") or "context_encoding_buckets" in options
    if "max_context_length" not in options and not bucketed:
        options["max_context_length"] = args.prompt_length
    # Speculation writes its proposed tokens past the last committed one.
    room = max(options.get("speculation_length", 0), options.get("medusa_speculation_length", 0))
    options.setdefault("seq_len", args.prompt_length + args.max_new_tokens + room)
    return options


def _check_lengths(args: argparse.Namespace, neuron_config: NeuronConfig) -> None:
    problems = []
    if args.prompt_length > neuron_config.max_context_length:
        problems.append(
            f"--prompt-length {args.prompt_length} exceeds max_context_length "
            f"{neuron_config.max_context_length}"
        )
    total = args.prompt_length + args.max_new_tokens
    if total > neuron_config.seq_len:
        problems.append(
            f"--prompt-length + --max-new-tokens = {total} exceeds seq_len {neuron_config.seq_len}"
        )
    if problems:
        raise NxdPlugError(
            "; ".join(problems) + "; raise --seq-len / --max-context-length or leave them unset"
        )


def _load_hf_model(model_path: Path, dtype: Any, quiet: bool) -> Any:
    """``AutoModelForCausalLM`` in ``dtype``; with ``quiet``, without its loading progress bar."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hide_bar = quiet and hf_logging.is_progress_bar_enabled()
    if hide_bar:
        hf_logging.disable_progress_bar()
    try:
        return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).eval()
    finally:
        if hide_bar:
            hf_logging.enable_progress_bar()


def run_benchmark(args: argparse.Namespace) -> int:
    import torch

    from nxdplug.plugins.benchmark import measurements as benchmark
    from nxdplug.plugins.benchmark import roofline

    def progress(message: str) -> None:
        if not args.quiet:
            print(f"benchmark: {message}", file=sys.stderr, flush=True)

    config = inference_config(args.model_path, benchmark_options(args))
    neuron_config = config.neuron_config
    _check_lengths(args, neuron_config)
    batch_size, dtype = neuron_config.batch_size, neuron_config.torch_dtype
    dtype_name = str(dtype).removeprefix("torch.")

    progress(f"loading {args.model_path} ({dtype_name}, batch {batch_size})")
    refuse_unused_draft(args, config)
    prepare_config(args, config)
    rss_before_load = []

    def before_load() -> None:
        rss_before_load.append(benchmark.rss_bytes())
        benchmark.reset_peak_rss()

    model = load_model(args, config, before_load=before_load)
    peak_rss = benchmark.peak_rss_bytes()  # before HF transformers' model is loaded
    rss_loaded = benchmark.rss_bytes()

    input_ids = _prompts(args, config.vocab_size, batch_size)
    if model.plugins.speculation_mode is not None:
        return _benchmark_speculation(args, model, input_ids, progress)
    new_tokens, runs = args.max_new_tokens, args.runs
    # The enabled plugins' per-step inputs (LoRA's adapter_ids, ...), and their HF equivalent.
    step_keywords = generate_keywords(args, model)
    base_without = enabling_settings(config, "benchmark")
    base = _base_application(args, config, base_without, progress) if base_without else None
    hf_systems = _hf_systems(args, model, dtype, progress)
    others = ["the base model"] * (base is not None) + [f"HF {m}" for m in _hf_modes(args)]
    if others:
        labels = ", ".join(others)
        progress(f"timing nxdplug and {labels} in turn: 1 warm-up + {runs} run(s) each")
    else:
        progress(f"timing nxdplug: 1 warm-up + {runs} run(s)")
    all_runs, warmups = benchmark.measure_alternating(
        model, hf_systems, input_ids, new_tokens, runs, step_keywords, base
    )
    stats = {
        name: benchmark.GenerationStats.from_runs(times, batch_size)
        for name, times in all_runs.items()
    }

    progress("measuring the GEMM peak")
    prefill = roofline.PrefillCeiling(
        gemm_flops_per_s=roofline.measure_gemm_flops(dtype),
        flops=roofline.prefill_flops(
            benchmark.weights_skeleton(model), config, batch_size, args.prompt_length
        ),
    )
    progress("measuring the memory read bandwidth")
    positions = benchmark.mean_decode_positions(args.prompt_length, new_tokens)
    report = benchmark.BenchmarkReport(
        config={
            "model": str(args.model_path),
            "dtype": dtype_name,
            "batch_size": batch_size,
            "prompt_length": args.prompt_length,
            "new_tokens": new_tokens,
            "runs": runs,
            "backend": model.backend_name,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        }
        | ({"base": ", ".join(base_without)} if base is not None else {}),
        nxdplug=stats["nxdplug"],
        base=stats.get("base"),
        hf=stats.get("hf"),
        read_gb_per_s=benchmark.measure_read_bandwidth(),
        bytes_per_step=benchmark.decode_bytes_per_step(model, batch_size, positions),
        mean_positions=positions,
        peak_rss=peak_rss,
        rss_before_load=rss_before_load[0],
        rss_loaded=rss_loaded,
        weight_bytes=benchmark.model_weight_bytes(model),
        hf_compiled=stats.get("hf_compiled"),
        warmup_seconds=warmups,
        prefill=prefill,
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format_table())
    return 0


def _base_application(
    args: argparse.Namespace, config: InferenceConfig, settings: tuple[str, ...], progress: Any
) -> NeuronBaseForCausalLM:
    """The same checkpoint and config with ``settings`` back at NeuronConfig's defaults,
    eager or compiled beside --compiled-model-path."""
    from nxdplug.plugin_api import load_pretrained_config

    progress(f"loading the base model (without {', '.join(settings)})")
    neuron_config = copy.deepcopy(config.neuron_config)
    defaults = type(neuron_config)()
    for name in settings:
        setattr(neuron_config, name, getattr(defaults, name, None))
    base_config = type(config)(neuron_config, load_config=load_pretrained_config(args.model_path))
    return application_beside(args, args.model_path, base_config, BASE_SUFFIX)


def _hf_modes(args: argparse.Namespace) -> tuple[str, ...]:
    """--compare-hf's modes, in HF_SYSTEMS order: none without it, every one with it alone."""
    if args.compare_hf is None:
        return ()
    return tuple(mode for mode in HF_SYSTEMS if mode in args.compare_hf or not args.compare_hf)


def _hf_systems(
    args: argparse.Namespace, model: NeuronBaseForCausalLM, dtype: Any, progress: Any
) -> dict[str, tuple[Any, dict[str, Any]]]:
    """HF transformers' model and ``generate()`` keywords for each --compare-hf mode, by report
    name: an enabled plugin's HF equivalent (LoRA's adapters, ...) or the plain checkpoint. Each
    mode has its model of its own, since compiling one changes its forward for good."""
    from nxdplug.plugins.benchmark import measurements as benchmark

    def load(path: Path) -> Any:
        return _load_hf_model(path, dtype, quiet=args.quiet)

    systems = {}
    for mode in _hf_modes(args):
        progress(f"loading the HF transformers model ({mode})")
        hf_model, hf_kwargs = hf_comparison(args, model, load) or (
            load(args.model_path),
            {},
        )
        if mode == "compiled":
            benchmark.compile_hf_generation(hf_model)
        systems[HF_SYSTEMS[mode]] = (hf_model, hf_kwargs)
    return systems


def _prompts(args: argparse.Namespace, vocab_size: int, batch_size: int) -> Any:
    """[batch, prompt_length] ids: from --prompt-file, or seeded random ones."""
    import torch

    from nxdplug.plugins.benchmark import measurements as benchmark

    if args.prompt_file is None:
        return benchmark.random_prompt_ids(vocab_size, batch_size, args.prompt_length)
    try:
        lines = args.prompt_file.read_text(encoding="utf-8").splitlines()
        rows = [json.loads(line)["input_ids"] for line in lines if line.strip()]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise NxdPlugError(
            f"--prompt-file {args.prompt_file}: expected JSON lines with an input_ids list "
            f"each ({type(exc).__name__}: {exc})"
        ) from exc
    usable = [row[: args.prompt_length] for row in rows if len(row) >= args.prompt_length]
    if len(usable) < batch_size:
        raise NxdPlugError(
            f"--prompt-file {args.prompt_file} has {len(usable)} prompt(s) of at least "
            f"{args.prompt_length} tokens; the batch needs {batch_size}: lower --prompt-length "
            "or --batch-size"
        )
    return torch.tensor(usable[:batch_size])


def _benchmark_speculation(
    args: argparse.Namespace, model: NeuronBaseForCausalLM, input_ids: Any, progress: Any
) -> int:
    """Whole generations with the config's speculation mode and without it, in turn."""
    import torch

    from nxdplug.plugins.benchmark import measurements as benchmark

    kwargs = generate_keywords(args, model)
    if args.prompt_lookup_num_tokens:
        kwargs["prompt_lookup_num_tokens"] = args.prompt_lookup_num_tokens
    proposer = (
        "draft model " + str(args.draft_model_path)
        if "assistant_model" in kwargs
        else f"prompt lookup of {args.prompt_lookup_num_tokens} token(s)"
        if args.prompt_lookup_num_tokens
        else "its own draft (fused or heads)"
    )
    progress("loading the same target without speculation")
    plain = plain_application(args, model.config)
    hf = _hf_speculation(args, model, input_ids.shape[0]) if _hf_modes(args) else None
    progress(f"timing with and without speculation in turn: 1 warm-up + {args.runs} run(s)")
    plain_seconds, speculative_seconds, acceptance, hf_seconds = benchmark.measure_speculation(
        plain, model, input_ids, args.max_new_tokens, args.runs, kwargs, hf
    )
    neuron_config = model.neuron_config
    report = benchmark.SpeculationReport(
        config={
            "model": str(args.model_path),
            "mode": model.plugins.speculation_mode.name,
            "proposer": proposer,
            "dtype": str(neuron_config.torch_dtype).removeprefix("torch."),
            "batch_size": neuron_config.batch_size,
            "prompt_length": args.prompt_length,
            "new_tokens": args.max_new_tokens,
            "runs": args.runs,
            "backend": model.backend_name,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        plain_seconds=plain_seconds,
        speculative_seconds=speculative_seconds,
        acceptance=acceptance.as_dict(),
        hf_speculative_seconds=hf_seconds,
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format_table())
    return 0


def _hf_speculation(
    args: argparse.Namespace, model: NeuronBaseForCausalLM, batch_size: int
) -> tuple[Any, dict]:
    """HF transformers' model and ``generate()`` keywords for the same speculation, from the
    speculation plugin's command-line extension; HF speculates at batch 1 only."""
    mode = model.plugins.speculation_mode.name
    if args.compare_hf and "eager" not in args.compare_hf:
        raise NxdPlugError(
            "--compare-hf compiled: speculation is compared with HF's eager assisted "
            "generation only; use --compare-hf eager"
        )
    if batch_size != 1:
        raise NxdPlugError(
            "--compare-hf with speculation needs --batch-size 1: HF transformers' assisted "
            "generation takes one sequence"
        )
    dtype = model.neuron_config.torch_dtype

    def load(path: Path) -> Any:
        return _load_hf_model(path, dtype, quiet=args.quiet)

    comparison = hf_comparison(args, model, load)
    if comparison is None:
        raise NxdPlugError(
            f"--compare-hf: HF transformers has no {mode} decoding to compare with; leave out "
            "--compare-hf (the benchmark compares with the target without speculation)"
        )
    return comparison
