"""The command line's speculative decoding: ``--draft-model-path`` and the acceptance report.

A draft checkpoint serves the mode the config selects: with ``speculation_length`` alone it
becomes a second application passed to ``generate(assistant_model=...)``; with fused
speculation (EAGLE) it goes into the config's ``fused_spec_config``, with the draft settings
the NxD Inference feature guide gives (a copy of the target's NeuronConfig, token generation
traced, not fused itself, ``is_eagle_draft`` for EAGLE).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

from nxdplug.errors import NxdPlugError

# NeuronConfig attributes that switch speculation on, and their off values.
SPECULATION_OFF = {
    "speculation_length": 0,
    "trace_tokengen_model": True,
    "enable_fused_speculation": False,
    "enable_eagle_speculation": False,
    "is_medusa": False,
    "medusa_speculation_length": 0,
    "num_medusa_heads": 0,
    "medusa_tree": None,
}


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
    """A copy of ``neuron_config`` with every speculation attribute off."""
    plain = copy.deepcopy(neuron_config)
    for name, value in SPECULATION_OFF.items():
        setattr(plain, name, value)
    return plain


def attach_fused_draft(config: Any, draft_path: Path) -> None:
    """Set ``config.fused_spec_config`` for the draft at ``draft_path``, as the feature guide
    builds it."""
    from nxdplug.config import FusedSpecNeuronConfig, load_pretrained_config
    from nxdplug.runtime.application import architecture_for

    worker_cls = architecture_for(draft_path).load("application")._model_cls
    neuron_config = config.neuron_config
    draft_neuron_config = copy.deepcopy(neuron_config)
    draft_neuron_config.trace_tokengen_model = True
    draft_neuron_config.enable_fused_speculation = False
    draft_neuron_config.enable_eagle_speculation = False
    draft_neuron_config.is_eagle_draft = bool(neuron_config.enable_eagle_speculation)
    draft_config = type(config)(draft_neuron_config, load_config=load_pretrained_config(draft_path))
    config.fused_spec_config = FusedSpecNeuronConfig(
        worker_cls=worker_cls, draft_config=draft_config, draft_model_path=str(draft_path)
    )


def _application_without_speculation(
    args: argparse.Namespace, model_path: Path, config: Any, suffix: str
) -> Any:
    """``model_path`` with ``config``'s settings, speculation off: eager, or compiled into a
    folder beside --compiled-model-path (its name plus ``suffix``)."""
    from nxdplug.config import load_pretrained_config
    from nxdplug.runtime.application import from_pretrained

    if not model_path.is_dir():
        raise NxdPlugError(f"{model_path} is not a folder")
    plain_config = type(config)(
        without_speculation(config.neuron_config), load_config=load_pretrained_config(model_path)
    )
    model = from_pretrained(model_path, config=plain_config)
    model.compiler_args = args.compiler_args
    if args.compiled_model_path is None:
        model.to_cpu()
    else:
        folder = args.compiled_model_path.with_name(args.compiled_model_path.name + suffix)
        model.compile(folder, quiet=args.quiet)
        model.load(folder, quiet=args.quiet)
    return model


def draft_application(args: argparse.Namespace, config: Any) -> Any:
    """The draft model of draft-model speculation."""
    return _application_without_speculation(args, args.draft_model_path, config, "-draft")


def plain_application(args: argparse.Namespace, config: Any) -> Any:
    """The target without speculation, for the benchmark's comparison."""
    return _application_without_speculation(args, args.model_path, config, "-plain")


def prepare_speculation(args: argparse.Namespace, config: Any) -> None:
    """Refuse a draft no mode uses; give a fused mode its draft (before the model is built)."""
    neuron_config = config.neuron_config
    if args.draft_model_path is None:
        return
    if neuron_config.enable_fused_speculation:
        attach_fused_draft(config, args.draft_model_path)
    elif not neuron_config.speculation_length:
        raise NxdPlugError(
            "--draft-model-path needs --speculation-length k (draft-model speculation) or "
            "--neuron-config enable_eagle_speculation=true (EAGLE)"
        )


def generate_keywords(args: argparse.Namespace, model: Any) -> dict[str, Any]:
    """``generate()`` keywords for the speculation mode: the draft application, if any."""
    if args.draft_model_path is None or model.neuron_config.enable_fused_speculation:
        return {}
    return {"assistant_model": draft_application(args, model.config)}


def acceptance_line(model: Any) -> str | None:
    stats = getattr(model, "speculation_stats", None)
    if stats is None or not stats.row_calls:
        return None
    return stats.summary()
