"""Command-line options shared by the commands that build, compile or run a model.

The option names follow NxD Inference's ``inference_demo`` and map one-to-one onto NeuronConfig
attributes (``--tp-degree`` is ``tp_degree``). Every option defaults to ``None`` and the
``*_kwargs`` functions return only the options the user gave, so NeuronConfig's own defaults
apply to everything else.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from nxdplug.cli.extensions import extension_config_kwargs
from nxdplug.errors import ConfigError

TORCH_DTYPES = ("bfloat16", "float16", "float32")
PADDING_SIDES = ("left", "right")
GENERIC_NEURON_CONFIG_DEST = "neuron_config_items"


def parse_key_value(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` to ``(key, value)``; the value is JSON when it parses, else the string.

    ``n=2`` gives ``2``, ``flag=true`` gives ``True``, ``act=silu`` gives ``"silu"``,
    ``scaling={"factor": 2.0}`` gives a dict.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(
            f"expected KEY=VALUE with KEY a Python identifier (e.g. batch_size=2); got {text!r}"
        )
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {value}")
    return value


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1]; got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1]; got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0; got {text!r}") from None
    if value <= 0.0:
        raise argparse.ArgumentTypeError(f"expected a number > 0; got {value}")
    return value


_FLAG = {"action": argparse.BooleanOptionalAction}
_BUCKETS = {"type": positive_int, "nargs": "+", "metavar": "N"}

# (flag, argparse keywords, help). The flag's dest is the NeuronConfig attribute.
_NEURON_CONFIG_OPTIONS: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("--batch-size", {"type": positive_int}, "inputs per request"),
    ("--seq-len", {"type": positive_int}, "longest sequence, prompt plus generated tokens"),
    ("--max-context-length", {"type": positive_int}, "longest prompt"),
    ("--torch-dtype", {"choices": TORCH_DTYPES}, "dtype of weights and computation"),
    ("--tp-degree", {"type": positive_int}, "tensor-parallel degree"),
    ("--padding-side", {"choices": PADDING_SIDES}, "side on which prompts are padded"),
    ("--enable-bucketing", _FLAG, "compile one graph per bucket size"),
    ("--context-encoding-buckets", _BUCKETS, "bucket sizes of the context-encoding model"),
    ("--token-generation-buckets", _BUCKETS, "bucket sizes of the token-generation model"),
    ("--fused-qkv", _FLAG, "fuse the Q, K and V projections into one"),
    ("--sequence-parallel-enabled", _FLAG, "sequence parallelism in norms and residuals"),
    ("--is-continuous-batching", _FLAG, "continuous batching (a KV-cache line per sequence)"),
    ("--ctx-batch-size", {"type": positive_int}, "batch size of context encoding"),
    ("--tkg-batch-size", {"type": positive_int}, "batch size of token generation"),
    ("--max-batch-size", {"type": positive_int}, "most sequences served at once"),
    ("--async-mode", _FLAG, "overlap host work with the next model step"),
    (
        "--compile-backend",
        {"metavar": "NAME"},
        "compile backend (see `nxdplug plugins list`); default: the best available",
    ),
    ("--output-logits", _FLAG, "return the logits along with the tokens"),
    (
        "--speculation-length",
        {"type": positive_int},
        "tokens speculated per step (draft model, prompt lookup, EAGLE)",
    ),
)

# (flag, argparse keywords, help). The flag's dest is the generate() keyword.
_SAMPLING_OPTIONS: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("--do-sample", _FLAG, "sample instead of greedy decoding"),
    ("--top-k", {"type": positive_int}, "sample among the k most likely tokens"),
    ("--top-p", {"type": _probability}, "sample within this cumulative probability"),
    ("--temperature", {"type": _positive_float}, "divide the logits by this"),
    ("--seed", {"type": int}, "random seed for sampling (not a generate() keyword)"),
    ("--max-new-tokens", {"type": positive_int}, "most tokens to generate per prompt"),
    ("--max-length", {"type": positive_int}, "most tokens per sequence, prompt included"),
    (
        "--prompt-lookup-num-tokens",
        {"type": positive_int},
        "speculate by n-gram lookup in the sequence (needs --speculation-length)",
    ),
)

SHARED_OPTIONS = {
    flag: (keywords, help_text)
    for flag, keywords, help_text in (*_NEURON_CONFIG_OPTIONS, *_SAMPLING_OPTIONS)
}


def add_shared_option(
    group: argparse._ActionsContainer, flag: str, **overrides: Any
) -> argparse.Action:
    """Add the NeuronConfig or sampling option ``flag`` as the other commands define it, with
    ``overrides`` replacing its argparse keywords (another default, another help)."""
    keywords, help_text = SHARED_OPTIONS[flag]
    return group.add_argument(flag, **({"default": None, "help": help_text} | keywords | overrides))


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _add_options(
    group: argparse._ArgumentGroup, options: Sequence[tuple[str, dict[str, Any], str]]
) -> None:
    for flag, keywords, help_text in options:
        group.add_argument(flag, default=None, help=help_text, **keywords)


def _given(
    args: argparse.Namespace, options: Sequence[tuple[str, dict[str, Any], str]]
) -> dict[str, Any]:
    values = {_dest(flag): getattr(args, _dest(flag), None) for flag, _, _ in options}
    return {key: value for key, value in values.items() if value is not None}


def add_neuron_config_options(parser: argparse.ArgumentParser) -> None:
    """Add the common NeuronConfig options and the generic ``--neuron-config KEY=VALUE``."""
    group = parser.add_argument_group("NeuronConfig", "Unset options keep NeuronConfig's defaults.")
    _add_options(group, _NEURON_CONFIG_OPTIONS)
    group.add_argument(
        "--neuron-config",
        dest=GENERIC_NEURON_CONFIG_DEST,
        action="append",
        type=parse_key_value,
        metavar="KEY=VALUE",
        help="any other NeuronConfig attribute; VALUE is parsed as JSON when it can be "
        "(repeatable, e.g. --neuron-config kv_cache_quant=true)",
    )


def neuron_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The NeuronConfig keyword arguments the user gave, explicit options and ``KEY=VALUE``."""
    kwargs = _given(args, _NEURON_CONFIG_OPTIONS)
    explicit = set(kwargs)
    twice = []
    for key, value in getattr(args, GENERIC_NEURON_CONFIG_DEST, None) or ():
        if key in explicit:
            twice.append(
                f"{key} is given both as --{key.replace('_', '-')} and as --neuron-config "
                f"{key}=...; keep one of them"
            )
        kwargs[key] = value  # the last KEY=VALUE of a repeated key wins, as on most CLIs
    for key, value in extension_config_kwargs(args).items():
        if key in kwargs:
            twice.append(
                f"{key} is given both by its plugin's options and as --{key.replace('_', '-')} "
                f"or --neuron-config {key}=...; keep one of them"
            )
        kwargs[key] = value
    if twice:
        raise ConfigError(twice, source="the command line")
    return kwargs


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    """Add the generation options (``--do-sample``, ``--top-k``, ..., ``--max-new-tokens``)."""
    group = parser.add_argument_group("sampling", "Unset options keep the model's defaults.")
    _add_options(group, _SAMPLING_OPTIONS)


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling options the user gave, keyed like ``generate()`` keywords, plus ``seed``."""
    return _given(args, _SAMPLING_OPTIONS)
