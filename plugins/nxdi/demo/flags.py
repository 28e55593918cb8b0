"""The flags of NxD Inference's ``inference_demo run``, and what nxdplug makes of each.

As in inference_demo, a flag named after a NeuronConfig attribute sets it (``--tp-degree``,
``--enable-bucketing``, ...): :func:`add_run_flags` adds one for each attribute of
MoENeuronConfig with a plain type (a model without that attribute reports it as unknown), set
only when given, so NeuronConfig's defaults, which are NxD Inference's, apply to the rest; the
options ``nxdplug run`` shares keep their definitions from :mod:`nxdplug.cli.options`. The
Neuron backend's kernel switches and compiler hints are such attributes: kept in the config,
reported once as without effect on other backends.

The other flags are in :data:`DEMO_FLAGS`, one :class:`DemoFlag` each, of one kind:

- ``config``: a NeuronConfig keyword that is not an attribute (``--router-act-fn``);
- ``demo``: read by the command itself (prompts, sampling, accuracy check, compile steps, ...);
- ``hint``: a Neuron compiler, kernel or runtime hint NeuronConfig has no attribute for: the
  results do not depend on it, and the command says once that it has no effect;
- ``refused``: a feature nxdplug lacks: giving the flag is a usage error naming it.

Feature plugins add their own inference_demo flags (``cli_extensions`` records naming the
``inference_demo`` command). A flag nxdplug supports for some values only (a parallel degree of
1, ...) refuses the others on parsing, with one line naming the flag.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from nxdplug.plugin_api import (
    SHARED_OPTIONS,
    TORCH_DTYPES,
    OptionsOnly,
    add_compiled_model_options,
    add_extension_arguments,
    add_model_path,
    add_shared_option,
    add_speculation_options,
    positive_int,
)

COMMAND = "inference_demo"
KINDS = ("config", "demo", "hint", "refused")
ACCURACY_MODES = {
    "skip-accuracy-check": "skip",
    "token-matching": "token-matching",
    "logit-matching": "logit-matching",
}


@attrs.frozen
class DemoFlag:
    """One inference_demo flag: its kind, argparse keywords (for an option ``nxdplug run``
    shares, what differs from its definition there) and a note (the help text, or why it is
    refused)."""

    flag: str
    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))
    keywords: dict[str, Any] = attrs.field(factory=dict)
    note: str = ""

    @property
    def dest(self) -> str:
        return self.keywords.get("dest", self.flag.lstrip("-").replace("-", "_"))


def only(value: Any, parse: Callable[[str], Any], why: str) -> Callable[[str], Any]:
    """An argparse type accepting ``value`` alone, the one nxdplug implements."""

    def check(text: str) -> Any:
        parsed = parse(text)
        if parsed != value:
            raise argparse.ArgumentTypeError(f"only {value} is supported: {why}")
        return parsed

    check.__name__ = parse.__name__
    return check


def accuracy_mode(text: str) -> str:
    """inference_demo's accuracy mode names to nxdplug's (``skip-accuracy-check`` is ``skip``)."""
    if text == "draft-logit-matching":
        raise argparse.ArgumentTypeError(
            "draft-logit-matching is not supported: check a speculating model by token matching"
        )
    if text not in ACCURACY_MODES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(ACCURACY_MODES)}")
    return ACCURACY_MODES[text]


AUTO = "auto"


class StringOrIntegers(argparse.Action):
    """NxD Inference's action for ``nargs="+"`` flags taking integers or the one word ``auto``:
    the namespace gets the list of integers, or the string ``"auto"``."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        words = [values] if isinstance(values, str) else list(values)
        if any(word.lower() == AUTO for word in words):
            if len(words) > 1:
                raise argparse.ArgumentError(
                    self, f"'{AUTO}' can only be used once and not with other arguments."
                )
            setattr(namespace, self.dest, AUTO)
            return
        try:
            setattr(namespace, self.dest, [int(word) for word in words])
        except ValueError:
            bad = next(word for word in words if not word.lstrip("-").isdigit())
            raise argparse.ArgumentError(
                self, f"'{bad}' is not a valid input. It must be '{AUTO}' or an integer."
            ) from None


def load_json_file(text: str) -> Any:
    """An argparse type: the JSON document in the file ``text``."""
    try:
        return json.loads(Path(text).read_text())
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read JSON from {text}: {exc}") from None


def modules_to_not_convert_file(text: str) -> tuple[list[str] | None, list[str] | None]:
    """The modules of the model and of the draft model that stay unconverted, as
    inference_demo reads them: ``{"model": {...}, "draft_model": {...}}`` or a flat
    ``{"modules_to_not_convert": [...]}``."""
    data = load_json_file(text)
    model = data.get("model", data).get("modules_to_not_convert")
    draft = data.get("draft_model", {}).get("modules_to_not_convert")
    return model, draft


def _demo(flag: str, note: str = "", **keywords: Any) -> DemoFlag:
    return DemoFlag(flag, "demo", keywords, note)


def _hint(flag: str, **keywords: Any) -> DemoFlag:
    note = "Neuron hint: no effect on this backend"
    return DemoFlag(flag, "hint", {"action": "store_true"} | keywords, note)


def _refused(flag: str, why: str, takes_value: bool = True) -> DemoFlag:
    return DemoFlag(flag, "refused", {"nargs": "*" if takes_value else 0}, why)


_ONE = "this parallelism is not implemented"

DEMO_FLAGS: tuple[DemoFlag, ...] = (
    _demo("--model-path"),
    _demo("--compiled-model-path"),
    _demo("--draft-model-path"),
    # Evaluation
    _demo("--benchmark", "time generation, write --benchmark-report-path", action="store_true"),
    _demo(
        "--check-accuracy-mode",
        "compare with HF transformers: skip-accuracy-check, token-matching or logit-matching",
        type=accuracy_mode,
        default="skip-accuracy-check",
    ),
    _demo("--expected-outputs-path", "torch.save'd expected outputs, instead of HF's"),
    _demo("--divergence-difference-tol", "logit matching", type=float, default=0.001),
    _demo("--tol-map", "logit matching: {top_k or None: (atol, rtol)}"),
    _demo("--num-tokens-to-check", "tokens the accuracy check compares", type=positive_int),
    _demo("--prompt", "a prompt (repeatable)", dest="prompts", action="append", required=True),
    # Sampling: the GenerationConfig (the sampling plugin's flags make the on-device config)
    _demo("--top-k", default=1),
    _demo("--top-p", default=1.0),
    _demo("--temperature", default=1.0),
    _demo("--do-sample", default=False),
    _demo("--pad-token-id", "the id finished rows are padded with", type=int, default=0),
    # Basic config
    DemoFlag(
        "--allow-input-truncation",
        "config",
        {"action": "store_true"},
        "cut prompts to max_context_length",
    ),
    _hint("--vocab-parallel"),
    _hint("--layer-boundary-markers"),
    _hint("--weight-gather-seq-len-threshold", action="store", type=int),
    # KV cache
    _demo("--kv-cache-batch-size", "KV-cache lines (max_batch_size here)", type=positive_int),
    _demo(
        "--kv-cache-padding-size",
        "spare KV-cache lines",
        type=only(0, int, "the KV cache has max_batch_size lines"),
    ),
    _hint("--disable-kv-cache-tiling"),
    # Bucketing
    _refused("--bucket-n-active-tokens", "bucketing n_active_tokens is not implemented", False),
    _demo(
        "--modules-to-not-convert-file",
        "JSON file of the modules left unconverted",
        type=modules_to_not_convert_file,
        dest="modules_to_not_convert_lists",
    ),
    # Mixture of experts: NeuronConfig keywords that are not attributes
    DemoFlag("--disable-normalize-top-k-affinities", "config", {"action": "store_true"}),
    DemoFlag("--router-act-fn", "config"),
    DemoFlag("--router-dtype", "config"),
    # Speculation
    _demo("--draft-model-tp-degree", "the draft runs on the target's ranks", type=positive_int),
    _demo("--compiled-draft-model-path", "where the draft model is compiled", type=Path),
    # Parallelism
    _demo("--cp-degree", type=only(1, int, _ONE)),
    _demo("--mlp-cp-degree", type=only(1, int, _ONE)),
    _demo("--attention-dp-degree", type=only(1, int, _ONE)),
    _demo("--pp-degree", type=only(1, int, _ONE)),
    _demo("--ep-degree", type=only(1, int, "set --moe-ep-degree for the experts")),
    _demo("--world-size", "ranks in all (tp_degree here)", type=positive_int),
    _demo("--start_rank_id", type=only(0, int, "a run spans one node")),
    _demo("--local_ranks_size", "ranks of this node (tp_degree here)", type=positive_int),
    _demo("--enable-torch-dist", "ranks synchronise through gloo", action="store_true"),
    _refused("--windowed-context-encoding-size", "windowed context encoding is not implemented"),
    # Kernels NeuronConfig has no attribute for
    _hint("--qkv-nki-kernel-enabled"),
    _hint("--qkv-cte-nki-kernel-fuse-rope"),
    _hint("--qkv-kernel-nbsd-layout"),
    _hint("--strided-context-parallel-kernel-enabled"),
    _hint("--fused-rmsnorm-skip-gamma"),
    _hint("--mlp-kernel-fuse-residual-add"),
    _hint("--qkv-kernel-fuse-residual-add"),
    _hint("--attn-block-tkg-nki-kernel-enabled"),
    _hint("--attn-block-tkg-nki-kernel-cascaded-attention"),
    _hint("--attn-block-tkg-nki-kernel-cache-update"),
    _hint("--k-cache-transposed"),
    _hint("--enable-spill-reload-dge"),
    _hint("--enable-output-completion-notifications"),
    _demo("--logical-neuron-cores", "deprecated: --logical-nc-config", type=positive_int),
    _demo("--benchmark-report-path", default="./benchmark_report.json"),
    # Debugging and the steps of the demo
    _demo(
        "--capture-indices",
        "save the model's inputs at these passes (0: context encoding), or 'auto': where "
        "logit matching fails",
        nargs="+",
        action=StringOrIntegers,
    ),
    _demo("--input-capture-save-dir", "where captured inputs go (default: here)", type=Path),
    _demo("--skip-compile", "load a compiled model without compiling", action="store_true"),
    _demo("--compile-only", "compile, then stop", action="store_true"),
    _demo(
        "--compile-dry-run", "check the config and plugins, compile nothing", action="store_true"
    ),
    _demo("--hlo-debug", "keep each graph annotated with source lines", action="store_true"),
    _refused(
        "--apply-seq-ids-mask", "masking KV-cache updates by seq_ids is not implemented", False
    ),
    _demo("--input-start-offsets", "shift each prompt right by this", nargs="+", type=int),
)

# The options other commands define together, added by their function.
_SHARED_GROUPS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "--model-path": add_model_path,
    "--compiled-model-path": lambda parser: add_compiled_model_options(parser, required=True),
    "--draft-model-path": add_speculation_options,
}
# NeuronConfig attributes that are not inference_demo settings.
_NOT_FLAGS = ("overrides_torch_dtype",)


class RefusedFlag(argparse.Action):
    """An argparse action refusing its flag, whose help says why: a feature nxdplug lacks."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        raise argparse.ArgumentError(self, f"not supported by nxdplug: {self.help}")


class FeatureDemoFlags(OptionsOnly):
    """A feature plugin's inference_demo flags, as the implementation of its ``CliExtension``
    record (``commands=("inference_demo",)``): one argument group titled ``TITLE``, whose flags
    :meth:`add_flags` adds and :meth:`settings` turns into NeuronConfig settings. ``DEST`` is a
    destination only these flags fill: arguments without it are another command's."""

    TITLE = ""
    DEST = ""

    def add_flags(self, group: argparse._ArgumentGroup) -> None:
        raise NotImplementedError

    def settings(self, args: argparse.Namespace) -> dict[str, Any]:
        return {}

    def add_arguments(self, parser: argparse.ArgumentParser, command: str) -> None:
        self.add_flags(parser.add_argument_group(self.TITLE))

    def neuron_config_kwargs(self, args: argparse.Namespace) -> dict[str, Any]:
        if not hasattr(args, self.DEST):  # another command's arguments
            return {}
        return self.settings(args)


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """Add inference_demo's ``run`` flags to ``parser``: :data:`DEMO_FLAGS`, one per
    NeuronConfig attribute, and those of the feature plugins (with ``--compiled-model-path``,
    nxdplug's ``--quiet``, ``--backend`` and ``--compiler-args``)."""
    for flag in DEMO_FLAGS:
        if flag.kind == "refused":
            parser.add_argument(flag.flag, action=RefusedFlag, help=flag.note, **flag.keywords)
        elif flag.flag in _SHARED_GROUPS:
            _SHARED_GROUPS[flag.flag](parser)
        elif flag.flag in SHARED_OPTIONS:
            add_shared_option(parser, flag.flag, **flag.keywords)
        else:
            keywords = {"default": None} | flag.keywords
            parser.add_argument(flag.flag, help=flag.note or None, **keywords)
    group = parser.add_argument_group("NeuronConfig", "One flag per attribute, set when given.")
    in_table = {flag.flag for flag in DEMO_FLAGS}
    for flag, keywords in attribute_flags():
        if flag in in_table:
            continue
        if flag in SHARED_OPTIONS:
            add_shared_option(group, flag)
        else:
            group.add_argument(flag, default=None, **keywords)
    add_extension_arguments(parser, COMMAND)


def attribute_flags() -> Iterator[tuple[str, dict[str, Any]]]:
    """``(--flag, argparse keywords)`` of each MoENeuronConfig attribute of a plain type."""
    from nxdplug.plugin_api import MoENeuronConfig

    for field in attrs.fields(MoENeuronConfig):
        keywords = _keywords_of(str(field.type).replace(" | None", ""))
        if keywords is not None and field.name not in _NOT_FLAGS:
            yield "--" + field.name.replace("_", "-"), keywords


def _keywords_of(annotation: str) -> dict[str, Any] | None:
    """argparse keywords for a field annotated ``annotation``; None for a sub-config."""
    simple = {"int": int, "float": float, "str": str}
    if annotation == "bool":
        return {"action": argparse.BooleanOptionalAction}
    if annotation in simple:
        return {"type": simple[annotation]}
    if annotation == "torch.dtype":
        return {"choices": TORCH_DTYPES}
    if annotation in ("list[int]", "list[str]"):
        return {"nargs": "+", "type": simple[annotation[5:-1]]}
    return None


def config_values(args: argparse.Namespace) -> dict[str, Any]:
    """The NeuronConfig keywords given: one per attribute flag, and the ``config`` flags."""
    names = [flag.lstrip("-").replace("-", "_") for flag, _ in attribute_flags()]
    names += [flag.dest for flag in DEMO_FLAGS if flag.kind == "config"]
    values = {name: getattr(args, name, None) for name in names}
    return {name: value for name, value in values.items() if value is not None}


def hints_given(args: argparse.Namespace, flags: Sequence[DemoFlag] = DEMO_FLAGS) -> list[str]:
    """The ``hint`` flags the user gave."""
    return [flag.flag for flag in flags if flag.kind == "hint" and getattr(args, flag.dest)]
