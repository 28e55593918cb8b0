"""inference_demo's EAGLE flag, for ``nxdplug inference_demo``: ``--token-tree-json FILE`` sets
the ``token_tree_config`` (the draft's tree, as NxD Inference's demo reads it). ``--is-eagle3``
is the core's flag of the NeuronConfig attribute."""

from __future__ import annotations

import argparse
from typing import Any

from nxdplug.nxdi.demo.flags import FeatureDemoFlags, load_json_file


class EagleDemoFlags(FeatureDemoFlags):
    TITLE = "EAGLE"
    DEST = "demo_token_tree"

    def add_flags(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--token-tree-json", dest="demo_token_tree", type=load_json_file, metavar="FILE"
        )

    def settings(self, args: argparse.Namespace) -> dict[str, Any]:
        tree = args.demo_token_tree
        return {} if tree is None else {"token_tree_config": tree}
