"""``nxdplug make-tiny-model``: a tiny random HF checkpoint of a registered architecture.

Its arguments are added whenever the ``nxdplug`` parser is built, so this module imports no
torch; the checkpoint code is imported when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nxdplug.plugin_api import parse_key_value


def add_make_tiny_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--architecture",
        required=True,
        metavar="NAME",
        help="a registered model architecture, e.g. llama (see `nxdplug plugins list`)",
    )
    parser.add_argument("--output", required=True, type=Path, metavar="DIR", help="new folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        type=parse_key_value,
        metavar="KEY=VALUE",
        help="a transformers config value, parsed as JSON when it can be "
        "(repeatable, e.g. --set num_hidden_layers=3)",
    )
    parser.add_argument("--force", action="store_true", help="replace a non-empty DIR")


def run_make_tiny_model(args: argparse.Namespace) -> int:
    from nxdplug.testing.tiny_models import make_tiny_checkpoint, summarize_checkpoint

    path = make_tiny_checkpoint(
        args.architecture,
        args.output,
        seed=args.seed,
        overrides=dict(args.overrides or ()),
        force=args.force,
    )
    print(path)
    print(summarize_checkpoint(path))
    return 0
