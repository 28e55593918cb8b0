"""inference_demo's EAGLE flags, for ``nxdplug inference_demo``: ``--token-tree-json FILE`` sets
the ``token_tree_config`` (the draft's tree, as NxD Inference's demo reads it); ``--is-eagle3``
is refused (the plugin drafts with EAGLE-1)."""

from __future__ import annotations

import argparse
from typing import Any

from nxdplug.cli.inference_demo_flags import FeatureDemoFlags, RefusedFlag, load_json_file


class EagleDemoFlags(FeatureDemoFlags):
    TITLE = "EAGLE"
    DEST = "demo_token_tree"

    def add_flags(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--token-tree-json", dest="demo_token_tree", type=load_json_file, metavar="FILE"
        )
        group.add_argument(
            "--is-eagle3", nargs=0, action=RefusedFlag, help="EAGLE-3 drafts are not implemented"
        )

    def settings(self, args: argparse.Namespace) -> dict[str, Any]:
        tree = args.demo_token_tree
        return {} if tree is None else {"token_tree_config": tree}
