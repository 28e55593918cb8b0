"""inference_demo's EAGLE flag, for ``nxdplug inference_demo``: ``--is-eagle3`` is refused (the
plugin drafts with EAGLE-1)."""

from __future__ import annotations

import argparse

from nxdplug.cli.inference_demo_flags import FeatureDemoFlags, RefusedFlag


class EagleDemoFlags(FeatureDemoFlags):
    TITLE = "EAGLE"
    DEST = "is_eagle3"

    def add_flags(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--is-eagle3", nargs=0, action=RefusedFlag, help="EAGLE-3 drafts are not implemented"
        )
