"""The command line's speculative decoding, whatever the mode: ``--draft-model-path``, the
target without speculation (the benchmark's baseline), and the acceptance report.

What a draft checkpoint means is the speculation plugin's (its ``cli_extensions`` record): a
second application passed to ``generate(assistant_model=...)``, or a draft fused into the
target's config.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nxdplug.cli.extensions import enabled_extensions
from nxdplug.errors import ConfigError, NxdPlugError
from nxdplug.registry import get_registry

if TYPE_CHECKING:
    from nxdplug.config import InferenceConfig, NeuronConfig
    from nxdplug.engine.speculative import SpeculativeConfig
    from nxdplug.runtime.application import NeuronBaseForCausalLM


def add_speculation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--draft-model-path",
        type=Path,
        default=None,
        metavar="DIR",
        help="draft checkpoint: a smaller LM for --speculation-length, or the EAGLE draft with "
        "--neuron-config enable_eagle_speculation=true",
    )


def without_speculation(neuron_config: NeuronConfig) -> NeuronConfig:
    """A copy of ``neuron_config`` that selects no speculation mode: every attribute that
    enables one set back to NeuronConfig's default, and token generation traced."""
    plain = copy.deepcopy(neuron_config)
    defaults = type(neuron_config)()
    for mode in get_registry().records("speculation_modes"):
        for name in mode.enabled_by:
            setattr(plain, name, getattr(defaults, name, None))
    # NxD Inference's settings of the fused draft are read only while speculating.
    plain.token_tree_config, plain.enable_token_tree = None, False
    plain.is_eagle3 = False
    plain.trace_tokengen_model = True
    return plain


def application_without_speculation(
    args: argparse.Namespace, model_path: Path, config: InferenceConfig, suffix: str
) -> NeuronBaseForCausalLM:
    """``model_path`` with ``config``'s settings, speculation off: eager, or compiled into a
    folder beside --compiled-model-path (its name plus ``suffix``)."""
    from nxdplug.cli.inference import application_beside  # which imports this module
    from nxdplug.config import load_pretrained_config

    if not model_path.is_dir():
        raise NxdPlugError(f"{model_path} is not a folder")
    plain_config = type(config)(
        without_speculation(config.neuron_config), load_config=load_pretrained_config(model_path)
    )
    return application_beside(args, model_path, plain_config, suffix)


def plain_application(args: argparse.Namespace, config: InferenceConfig) -> NeuronBaseForCausalLM:
    """The target without speculation, for the benchmark's comparison."""
    return application_without_speculation(args, args.model_path, config, "-plain")


def refuse_unused_draft(args: argparse.Namespace, config: InferenceConfig) -> None:
    """A draft checkpoint that no enabled plugin uses is a mistake, not something to ignore."""
    if args.draft_model_path is not None and not any(enabled_extensions(config)):
        raise NxdPlugError(
            "--draft-model-path needs --speculation-length k (draft-model speculation) or "
            "--neuron-config enable_eagle_speculation=true (EAGLE)"
        )


def acceptance_line(model: NeuronBaseForCausalLM) -> str | None:
    stats = getattr(model, "speculation_stats", None)
    if stats is None or not stats.row_calls:
        return None
    return stats.summary()


def add_speculative_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='speculate in the engine, as vLLM\'s flag: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\', \'{"method": '
        '"draft_model", "model": DIR, "num_speculative_tokens": 4}\' (with tensor parallelism '
        'the draft is sharded as the target; "draft_tensor_parallel_size": 1 runs it whole on '
        "the first rank), eagle / eagle3 (model: the EAGLE draft), medusa (model: the heads' "
        'folder); a tree: "speculative_token_tree": "[(0,), (1,), (0, 0)]"',
    )


def _speculative_config(text: str) -> SpeculativeConfig:
    from nxdplug.engine.speculative import SpeculativeConfig  # the engine imports torch

    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(values, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    try:
        config = SpeculativeConfig.from_mapping(values, "--speculative-config")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError("; ".join(exc.problems)) from None
    if config.num_speculative_tokens is None:
        raise argparse.ArgumentTypeError("give num_speculative_tokens (the tokens proposed a step)")
    return config


def speculation_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The NeuronConfig settings --speculative-config makes: the verification phase of
    num_speculative_tokens + 1 tokens, and what the speculation mode serving its method adds
    (``engine_settings``)."""
    config = args.speculative_config
    if config is None:
        return {}
    given = args.speculation_length
    if given is not None and given != config.num_speculative_tokens:
        raise NxdPlugError(
            f"--speculation-length {given} and --speculative-config's num_speculative_tokens "
            f"{config.num_speculative_tokens} disagree; give one of them"
        )
    modes = get_registry().records("speculation_modes")
    serving = [mode for mode in modes if config.method in mode.engine_methods]
    if not serving:
        served = sorted({method for mode in modes for method in mode.engine_methods})
        raise NxdPlugError(
            f"--speculative-config's method {config.method!r} is served by no installed "
            f"speculation mode; these are: {', '.join(served)}"
        )
    settings = {"speculation_length": config.num_speculative_tokens}
    mode = serving[0]
    if mode.engine_settings is not None:
        settings |= mode.load("engine_settings")(config)
    return settings


def engine_draft(args: argparse.Namespace, config: InferenceConfig) -> NeuronBaseForCausalLM | None:
    """The draft application of --speculative-config's ``model`` for ``draft_model`` (None
    otherwise): the target's settings without speculation and with lines of its own (no
    block layout), compiled and loaded as the target is (beside --compiled-model-path, with
    ``-draft``). With tensor parallelism every rank calls it: with ``draft_tensor_parallel_size``
    the target's (the default) each builds its shard of the draft; with 1 the first rank
    builds the whole draft for itself alone, and the others get None."""
    from nxdplug.cli.inference import load_model  # which imports this module
    from nxdplug.config import load_pretrained_config
    from nxdplug.engine.speculative import draft_ranks
    from nxdplug.modules.parallel_linear import tp_rank
    from nxdplug.modules.process_groups import this_rank_alone

    speculative = args.speculative_config
    if speculative is None or speculative.method != "draft_model" or speculative.model is None:
        return None
    try:
        ranks = draft_ranks(speculative, config.neuron_config.tp_degree)
    except ConfigError as exc:
        raise NxdPlugError(f"--speculative-config: {'; '.join(exc.problems)}") from None
    path = Path(speculative.model)
    if not path.is_dir():
        raise NxdPlugError(f"--speculative-config's model {path} is not a folder")
    alone = ranks < config.neuron_config.tp_degree
    if alone and tp_rank() != 0:
        return None
    neuron_config = without_speculation(config.neuron_config)
    neuron_config.tp_degree = ranks
    for name in ("is_block_kv_layout", "is_prefix_caching", "is_chunked_prefill"):
        if getattr(neuron_config, name, False):
            setattr(neuron_config, name, False)
    neuron_config.chunked_prefill_config = None
    draft_config = type(config)(neuron_config, load_config=load_pretrained_config(path))
    folder = args.compiled_model_path
    beside = None if folder is None else folder.with_name(folder.name + "-draft")
    draft_args = argparse.Namespace(
        **vars(args) | {"model_path": path, "compiled_model_path": beside}
    )
    with this_rank_alone() if alone else contextlib.nullcontext():
        return load_model(draft_args, draft_config, compile_by_default=True)
