"""inference_demo's quantization flags, for ``nxdplug inference_demo``: accepted for what the
plugin does (weights only), refused otherwise."""

from __future__ import annotations

import argparse
import math

from nxdplug.nxdi.demo.flags import FeatureDemoFlags, RefusedFlag, only


class QuantizationDemoFlags(FeatureDemoFlags):
    TITLE = "quantization"
    DEST = "quantize_clamp_bound"

    def add_flags(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--activation-quantization-type",
            nargs="*",
            action=RefusedFlag,
            help="activation quantization is not implemented",
        )
        why = "activations are not quantized, so nothing is clamped"
        group.add_argument(
            "--quantize-clamp-bound", type=only(math.inf, float, why), default=math.inf
        )
