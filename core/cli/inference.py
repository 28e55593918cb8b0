"""``nxdplug check-config`` and ``nxdplug run``: resolve a config, generate text, check accuracy.

``run`` follows NxD Inference's inference_demo: a checkpoint, prompts, NeuronConfig options,
sampling options, then an optional accuracy check against HF transformers on the same weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nxdplug.cli import extensions
from nxdplug.cli.options import (
    add_neuron_config_options,
    add_sampling_options,
    neuron_config_kwargs,
    sampling_kwargs,
)
from nxdplug.cli.speculation import acceptance_line, add_speculation_options, refuse_unused_draft
from nxdplug.errors import NotSupportedError, NxdPlugError

if TYPE_CHECKING:
    from nxdplug.config import InferenceConfig
    from nxdplug.pipeline import PluginSelection
    from nxdplug.runtime.application import NeuronBaseForCausalLM


def add_model_path(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-path", required=True, type=Path, metavar="DIR", help="an HF checkpoint folder"
    )


def inference_config(model_path: Path, options: dict[str, Any]) -> InferenceConfig:
    from nxdplug.config import load_pretrained_config
    from nxdplug.runtime.application import architecture_for

    if not model_path.is_dir():
        raise NxdPlugError(f"--model-path {model_path} is not a folder")
    config_cls = architecture_for(model_path).load("application").get_config_cls()
    neuron_config = config_cls.get_neuron_config_cls()(**options)
    return config_cls(neuron_config, load_config=load_pretrained_config(model_path))


# check-config ---------------------------------------------------------------------------------


def add_check_config_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_path(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--explain",
        action="store_true",
        help="name the plugin or backend that handles each attribute set to other than its default",
    )
    add_neuron_config_options(parser)
    extensions.add_extension_arguments(parser, "check-config")


def selection_summary(selection: PluginSelection) -> dict[str, Any]:
    return {
        "model": selection.architecture.name if selection.architecture else None,
        "features": [f.name for f in selection.features],
        "kv_cache_strategy": selection.kv_cache_strategy.name,
        "speculation_mode": selection.speculation_mode.name if selection.speculation_mode else None,
        "compile_backend": selection.compile_backend.name,
        "state_dict_converters": [c.name for c in selection.converters],
        "plugins": sorted(selection.plugins),
    }


def run_check_config(args: argparse.Namespace) -> int:
    from nxdplug.cli.coverage import explain
    from nxdplug.pipeline import config_problems, select_plugins

    config = inference_config(args.model_path, neuron_config_kwargs(args))
    problems = config_problems(config)
    try:
        summary: dict[str, Any] | None = selection_summary(select_plugins(config))
    except NxdPlugError:
        summary = None  # the reason is among the problems
    handled_by = explain(config.neuron_config) if args.explain else None
    if args.json:
        report = {"plugins": summary, "problems": problems}
        if handled_by is not None:
            report["handled_by"] = handled_by
        print(json.dumps(report, indent=2))
    else:
        if summary is not None:
            for key, value in summary.items():
                shown = ", ".join(value) if isinstance(value, list) else value
                print(f"{key:22} {shown or '-'}")
        if handled_by is not None:
            print("\nattributes set, and what handles them:")
            print("\n".join(f"  {name:40} {who}" for name, who in handled_by.items()) or "  -")
        if problems:
            print(f"\n{len(problems)} problem(s):")
            print("\n".join(f"  - {p}" for p in problems))
        else:
            print("\nno problems found")
    return 1 if problems else 0


# run ------------------------------------------------------------------------------------------


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_path(parser)
    parser.add_argument(
        "--prompt",
        dest="prompts",
        action="append",
        required=True,
        metavar="TEXT",
        help="a prompt (repeatable: one per batch row)",
    )
    parser.add_argument(
        "--check-accuracy-mode",
        choices=("token-matching", "logit-matching", "skip"),
        default="skip",
        help="compare with HF transformers on the same checkpoint",
    )
    add_compiled_model_options(parser, required=False)
    add_speculation_options(parser)
    add_neuron_config_options(parser)
    add_sampling_options(parser)
    extensions.add_extension_arguments(parser, "run")


def load_tokenizer(model_path: Path, command: str, **kwargs: Any) -> Any:
    """The checkpoint's tokenizer (``kwargs`` go to ``AutoTokenizer.from_pretrained``); a
    folder without one is a user error naming ``command``."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_path), **kwargs)
    except (OSError, ValueError) as exc:
        raise NxdPlugError(
            f"no usable tokenizer in {model_path} ({type(exc).__name__}); `nxdplug {command}` "
            "needs tokenizer.json / tokenizer_config.json beside the weights"
        ) from exc


def add_compiled_model_options(
    parser: argparse.ArgumentParser,
    required: bool,
    without: str = "the model runs eagerly (to_cpu)",
) -> None:
    """--compiled-model-path, --quiet and --backend, shared by the commands that load models
    (``without``: what happens when an optional --compiled-model-path is left out)."""
    parser.add_argument(
        "--compiled-model-path",
        type=Path,
        required=required,
        metavar="DIR",
        help="compile into DIR (a folder already matching this config is reused) and load "
        "from it" + ("" if required else f"; without it {without}"),
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument(
        "--backend",
        dest="compile_backend",
        default=None,
        metavar="NAME",
        help="compile backend, the same as --compile-backend (default: the best available)",
    )
    parser.add_argument(
        "--compiler-args",
        default=None,
        metavar="ARGS",
        help='compile backend arguments; for inductor, "freezing=true max_autotune=true" folds '
        "the weights into each graph: faster decoding, no weight swapping",
    )


def load_model(
    args: argparse.Namespace,
    config: InferenceConfig,
    before_load: Callable[[], None] | None = None,
    *,
    compile_by_default: bool = False,
) -> NeuronBaseForCausalLM:
    """The application, compiled and loaded from --compiled-model-path, or eager on the CPU.
    ``before_load`` runs once compiling is done, just before the weights are loaded.
    ``compile_by_default``: without --compiled-model-path (nor --enforce-eager), compile into
    the cache's folder for this config (see :mod:`nxdplug.compile.default_folder`)."""
    from nxdplug.runtime.application import from_pretrained

    into_cache = compile_by_default and args.compiled_model_path is None and not args.enforce_eager
    if into_cache:
        config.neuron_config.save_sharded_checkpoint = False  # the cache keeps graphs alone
    model = from_pretrained(args.model_path, config=config)
    model.compiler_args = args.compiler_args
    folder = _default_folder(model) if into_cache else args.compiled_model_path
    if folder is not None:
        model.compile(folder, quiet=args.quiet)
    if before_load is not None:
        before_load()
    if folder is None:
        model.to_cpu()
    else:
        model.load(folder, quiet=args.quiet)
    return model


def _default_folder(model: NeuronBaseForCausalLM) -> Path | None:
    """The cache's folder for ``model``, or None (said on stderr) where it runs eagerly."""
    from nxdplug.compile.default_folder import default_compiled_folder

    if model.neuron_config.on_cpu:
        return None  # NxD Inference's CPU mode: eager by definition
    try:
        return default_compiled_folder(model)
    except NotSupportedError as exc:
        print(f"nxdplug: running eagerly, without compiling: {exc}", file=sys.stderr)
        return None


def application_beside(
    args: argparse.Namespace, model_path: Path, config: InferenceConfig, suffix: str
) -> NeuronBaseForCausalLM:
    """A second application, ``model_path`` with ``config``, run as --compiled-model-path says:
    eager, or compiled into a folder beside it (its name plus ``suffix``) and loaded."""
    from nxdplug.runtime.application import from_pretrained

    model = from_pretrained(model_path, config=config)
    model.compiler_args = args.compiler_args
    if args.compiled_model_path is None:
        model.to_cpu()
    else:
        folder = args.compiled_model_path.with_name(args.compiled_model_path.name + suffix)
        model.compile(folder, quiet=args.quiet)
        model.load(folder, quiet=args.quiet)
    return model


def add_compile_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_path(parser)
    add_compiled_model_options(parser, required=True)
    parser.add_argument(
        "--debug", action="store_true", help="keep each exported graph, annotated with source lines"
    )
    add_neuron_config_options(parser)
    extensions.add_extension_arguments(parser, "compile")


def run_compile(args: argparse.Namespace) -> int:
    from nxdplug.runtime.application import from_pretrained

    config = inference_config(args.model_path, neuron_config_kwargs(args))
    model = from_pretrained(args.model_path, config=config)
    model.compiler_args = args.compiler_args
    model.compile(args.compiled_model_path, debug=args.debug, quiet=args.quiet)
    print(args.compiled_model_path)
    return 0


def run_run(args: argparse.Namespace) -> int:
    import torch

    from nxdplug.generation.hf_adapter import HuggingFaceGenerationAdapter

    options = {"batch_size": len(args.prompts)} | neuron_config_kwargs(args)
    config = inference_config(args.model_path, options)
    generation = sampling_kwargs(args)
    seed = generation.pop("seed", None)
    if seed is not None:
        torch.manual_seed(seed)

    refuse_unused_draft(args, config)
    extensions.prepare_config(args, config)
    model = load_model(args, config)
    if args.check_accuracy_mode == "logit-matching" and model.plugins.speculation_mode:
        raise NxdPlugError(
            "--check-accuracy-mode logit-matching compares one token per step, which a "
            "speculating model does not compute; use token-matching"
        )
    generation |= extensions.generate_keywords(args, model)
    tokenizer = load_tokenizer(
        args.model_path, "run", padding_side=config.neuron_config.padding_side
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(args.prompts, return_tensors="pt", padding=True)

    adapter = HuggingFaceGenerationAdapter(model)
    start = time.perf_counter()
    with torch.inference_mode():
        outputs = adapter.generate(
            batch.input_ids, attention_mask=batch.attention_mask, **generation
        )
    seconds = time.perf_counter() - start
    new_tokens = outputs[:, batch.input_ids.shape[1] :]
    print("Generated outputs:")
    for index, (prompt, text) in enumerate(
        zip(args.prompts, tokenizer.batch_decode(new_tokens, skip_special_tokens=True), strict=True)
    ):
        print(f"Output {index}: {prompt}{text}")
    count = new_tokens.numel()
    rate = f"{count / seconds:.1f} tokens/s"
    print(f"\n{count} new tokens in {seconds:.2f} s ({rate}, {model.backend_name} backend)")
    acceptance = acceptance_line(model)
    if acceptance is not None:
        print(acceptance)

    if args.check_accuracy_mode == "skip":
        return 0
    speculation = {key: generation[key] for key in SPECULATION_KEYWORDS if key in generation}
    return _check_accuracy(args, model, batch, new_tokens.shape[1], speculation)


SPECULATION_KEYWORDS = ("assistant_model", "prompt_lookup_num_tokens")


def _check_accuracy(
    args: argparse.Namespace,
    model: NeuronBaseForCausalLM,
    batch: Any,
    new_tokens: int,
    speculation: dict[str, Any],
) -> int:
    from nxdplug.generation.hf_matching import compare_with_hf

    hf_model = model.load_hf_model(args.model_path, dtype=model.neuron_config.torch_dtype).eval()
    report = compare_with_hf(
        model,
        hf_model,
        batch.input_ids,
        batch.attention_mask,
        max_new_tokens=new_tokens,
        mode=args.check_accuracy_mode,
        generate_kwargs=speculation,
    )
    print(report.summary())
    return 0 if report.passed else 1
