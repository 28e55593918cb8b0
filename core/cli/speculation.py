"""The command line's speculative decoding, whatever the mode: ``--draft-model-path``, the
target without speculation (the benchmark's baseline), and the acceptance report.

What a draft checkpoint means is the speculation plugin's (its ``cli_extensions`` record): a
second application passed to ``generate(assistant_model=...)``, or a draft fused into the
target's config.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

from nxdplug.cli.extensions import enabled_extensions
from nxdplug.errors import NxdPlugError
from nxdplug.registry import get_registry


def add_speculation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--draft-model-path",
        type=Path,
        default=None,
        metavar="DIR",
        help="draft checkpoint: a smaller LM for --speculation-length, or the EAGLE draft with "
        "--neuron-config enable_eagle_speculation=true",
    )


def without_speculation(neuron_config: Any) -> Any:
    """A copy of ``neuron_config`` that selects no speculation mode: every attribute that
    enables one set back to NeuronConfig's default, and token generation traced."""
    plain = copy.deepcopy(neuron_config)
    defaults = type(neuron_config)()
    for mode in get_registry().records("speculation_modes"):
        for name in mode.enabled_by:
            setattr(plain, name, getattr(defaults, name, None))
    plain.trace_tokengen_model = True
    return plain


def application_without_speculation(
    args: argparse.Namespace, model_path: Path, config: Any, suffix: str
) -> Any:
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


def plain_application(args: argparse.Namespace, config: Any) -> Any:
    """The target without speculation, for the benchmark's comparison."""
    return application_without_speculation(args, args.model_path, config, "-plain")


def refuse_unused_draft(args: argparse.Namespace, config: Any) -> None:
    """A draft checkpoint that no enabled plugin uses is a mistake, not something to ignore."""
    if args.draft_model_path is not None and not any(enabled_extensions(config)):
        raise NxdPlugError(
            "--draft-model-path needs --speculation-length k (draft-model speculation) or "
            "--neuron-config enable_eagle_speculation=true (EAGLE)"
        )


def acceptance_line(model: Any) -> str | None:
    stats = getattr(model, "speculation_stats", None)
    if stats is None or not stats.row_calls:
        return None
    return stats.summary()
