"""``nxdplug inference_demo``: NxD Inference's ``inference_demo`` command line, run by nxdplug.

``nxdplug inference_demo --model-type llama --task-type causal-lm run --model-path M
--compiled-model-path C --prompt TEXT ...`` compiles the model into C (unless ``--skip-compile``
or ``--on-cpu``), stops there with ``--compile-only``, loads it, checks its accuracy as
``--check-accuracy-mode`` asks, generates from the prompts and prints each output, then times it
with ``--benchmark``. What nxdplug makes of each flag is in
:mod:`nxdplug.nxdi.demo.flags`; a flag for a feature nxdplug lacks is a usage error.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from nxdplug.nxdi.demo.flags import COMMAND, add_run_flags, config_values, hints_given
from nxdplug.plugin_api import (
    NxdPlugError,
    extension_config_kwargs,
    inference_config,
    prepare_config,
    refuse_unused_draft,
    selection_summary,
    without_speculation,
)

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, NeuronBaseForCausalLM, NeuronConfig

TASK_TYPES = ("causal-lm",)


class DemoUsageError(NxdPlugError):
    """Flags that cannot be run together, or a value nxdplug does not support (exit code 2)."""


def add_inference_demo_arguments(parser: argparse.ArgumentParser) -> None:
    from nxdplug.plugin_api import get_registry

    families = sorted(r.name for r in get_registry().records("model_architectures"))
    parser.add_argument("--model-type", required=True, choices=families, help="model family")
    parser.add_argument("--task-type", required=True, choices=TASK_TYPES)
    commands = parser.add_subparsers(
        title="commands", metavar="COMMAND", required=True, parser_class=_lazy(type(parser))
    )
    commands.add_parser("run", help="compile, load, check accuracy, generate, benchmark")


def _lazy(base: type[argparse.ArgumentParser]) -> type[argparse.ArgumentParser]:
    """``base`` adding the run flags when first used: finding them imports torch, which the
    other commands must not wait for."""

    class RunParser(base):  # type: ignore[misc, valid-type]
        flags_added = False

        def add_flags(self) -> None:
            if not self.flags_added:
                self.flags_added = True
                add_run_flags(self)

        def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
            self.add_flags()
            return super().parse_known_args(args, namespace)

        def format_help(self) -> str:
            self.add_flags()
            return super().format_help()

    return RunParser


def main(argv: list[str] | None = None) -> int:
    """The ``inference_demo`` console script: ``nxdplug inference_demo`` with these flags."""
    from nxdplug.plugin_api import main as nxdplug_main

    return nxdplug_main([COMMAND, *(sys.argv[1:] if argv is None else argv)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """NxD Inference's ``inference_demo.parse_args``: the flags (``sys.argv``'s by default)
    parsed as ``nxdplug inference_demo`` parses them."""
    from nxdplug.plugin_api import build_parser

    return build_parser().parse_args([COMMAND, *(sys.argv[1:] if argv is None else argv)])


def create_neuron_config(
    model_cls: type[NeuronBaseForCausalLM], args: argparse.Namespace
) -> NeuronConfig:
    """NxD Inference's ``inference_demo.create_neuron_config``: the model class's NeuronConfig
    of the parsed flags, the features' sub-configs included."""
    return model_cls.get_neuron_config_cls()(**neuron_config_options(args))


def console_main() -> NoReturn:
    """The ``inference_demo`` console script, ending as ``nxdplug`` does."""
    from nxdplug.plugin_api import exit_with

    exit_with(main())


def run_inference_demo(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except DemoUsageError as exc:
        print(f"nxdplug: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from nxdplug.plugin_api import architecture_for, from_pretrained

    family = architecture_for(args.model_path).name
    if family != args.model_type:
        raise DemoUsageError(f"--model-type {args.model_type}: {args.model_path} is a {family}")
    config = inference_config(args.model_path, neuron_config_options(args))
    _check_flag_values(args, config.neuron_config)
    hints = hints_given(args)
    if hints:
        warnings.warn(
            f"{', '.join(hints)}: Neuron compiler or kernel hint(s), no effect on this backend",
            RuntimeWarning,
            stacklevel=2,
        )
    if args.compile_dry_run:
        return _dry_run(config)
    refuse_unused_draft(args, config)
    prepare_config(args, config)

    model = from_pretrained(args.model_path, config=config)
    model.compiler_args = args.compiler_args
    draft = _draft_application(args, config)
    if config.neuron_config.quantized:
        type(model).save_quantized_state_dict(args.model_path, config)
    if args.skip_compile or args.on_cpu:
        print("Skipping model compilation")
    else:
        start = time.monotonic()
        model.compile(args.compiled_model_path, debug=args.hlo_debug, quiet=args.quiet)
        if draft is not None:
            draft.compile(_draft_folder(args), debug=args.hlo_debug, quiet=args.quiet)
        print(f"Compiling and tracing time: {time.monotonic() - start:.2f} seconds")
    if args.compile_only:
        return 0

    start = time.monotonic()
    for application, folder in ((model, args.compiled_model_path), (draft, _draft_folder(args))):
        if application is None:
            continue
        if args.on_cpu:
            application.to_cpu()
        else:
            application.load(folder, quiet=args.quiet)
    print(f"Total model loading time: {time.monotonic() - start:.2f} seconds")

    from nxdplug.nxdi.demo.run import run_loaded

    return run_loaded(args, model, draft)


def neuron_config_options(args: argparse.Namespace) -> dict[str, Any]:
    """The NeuronConfig keywords of the flags given, as inference_demo builds them."""
    options = {"batch_size": len(args.prompts)} | config_values(args)
    if args.logical_neuron_cores is not None:
        if args.logical_nc_config is not None:
            raise DemoUsageError(
                "give --logical-nc-config alone; --logical-neuron-cores is its old name"
            )
        warnings.warn(
            "--logical-neuron-cores is deprecated; use --logical-nc-config",
            FutureWarning,
            stacklevel=2,
        )
        options["logical_nc_config"] = args.logical_neuron_cores
    if args.modules_to_not_convert_lists is not None:
        model, draft = args.modules_to_not_convert_lists
        if model is not None:
            options["modules_to_not_convert"] = model
        if draft is not None:
            options["draft_model_modules_to_not_convert"] = draft
    from_plugins = extension_config_kwargs(args)
    twice = sorted(set(options) & set(from_plugins))
    if twice:
        raise DemoUsageError(f"{', '.join(twice)} given twice (by a plugin's flags too); keep one")
    return options | from_plugins


def _check_flag_values(args: argparse.Namespace, neuron_config: NeuronConfig) -> None:
    """The flags nxdplug supports for the values that match what it does, and no other."""
    tp = neuron_config.tp_degree
    equal = {
        "--kv-cache-batch-size": (
            args.kv_cache_batch_size,
            neuron_config.max_batch_size,
            "a KV-cache line per sequence, max_batch_size lines",
        ),
        "--world-size": (args.world_size, tp, "every rank is a tensor-parallel rank"),
        "--local_ranks_size": (args.local_ranks_size, tp, "a run spans one node"),
        "--draft-model-tp-degree": (
            args.draft_model_tp_degree,
            tp,
            "the draft runs on the target's ranks",
        ),
    }
    for flag, (given, supported, why) in equal.items():
        if given is not None and given != supported:
            raise DemoUsageError(f"{flag} {given} is not supported: only {supported} ({why})")
    if args.input_start_offsets and len(args.input_start_offsets) not in (1, len(args.prompts)):
        raise DemoUsageError("--input-start-offsets takes one offset, or one per prompt")


def _dry_run(config: InferenceConfig) -> int:
    """What ``--compile-dry-run`` does here: resolve the plugins and report every problem."""
    from nxdplug.plugin_api import config_problems, select_plugins

    problems = config_problems(config)
    if not problems:
        for key, value in selection_summary(select_plugins(config)).items():
            print(f"{key:22} {', '.join(value) if isinstance(value, list) else value or '-'}")
    print("\n".join(f"problem: {p}" for p in problems) or "no problems found")
    return 1 if problems else 0


def _draft_application(
    args: argparse.Namespace, config: InferenceConfig
) -> NeuronBaseForCausalLM | None:
    """The draft model of draft-model speculation (a separate application, as inference_demo
    builds it), or None: fused speculation (EAGLE) builds its draft into the target."""
    from nxdplug.plugin_api import from_pretrained, load_pretrained_config

    neuron_config = config.neuron_config
    if (
        args.draft_model_path is None
        or not neuron_config.speculation_length
        or neuron_config.enable_fused_speculation
    ):
        return None
    draft_config = type(config)(
        without_speculation(neuron_config),
        load_config=load_pretrained_config(args.draft_model_path),
    )
    draft = from_pretrained(args.draft_model_path, config=draft_config)
    draft.compiler_args = args.compiler_args
    return draft


def _draft_folder(args: argparse.Namespace) -> Path:
    if args.compiled_draft_model_path is not None:
        return args.compiled_draft_model_path
    return args.compiled_model_path.with_name(args.compiled_model_path.name + "-draft")
