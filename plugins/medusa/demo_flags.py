"""inference_demo's Medusa flag, for ``nxdplug inference_demo``: ``--medusa-tree-json FILE``
sets the ``medusa_tree``."""

from __future__ import annotations

import argparse
from typing import Any

from nxdplug.nxdi.demo.flags import FeatureDemoFlags, load_json_file


class MedusaDemoFlags(FeatureDemoFlags):
    TITLE = "Medusa"
    DEST = "demo_medusa_tree"

    def add_flags(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--medusa-tree-json", dest="demo_medusa_tree", type=load_json_file, metavar="FILE"
        )

    def settings(self, args: argparse.Namespace) -> dict[str, Any]:
        return {} if args.demo_medusa_tree is None else {"medusa_tree": args.demo_medusa_tree}
