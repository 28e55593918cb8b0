"""inference_demo's on-device sampling flags, for ``nxdplug inference_demo``:
``--on-device-sampling`` ... make the ``on_device_sampling_config``."""

from __future__ import annotations

import argparse
from typing import Any

from nxdplug.nxdi.demo.flags import FeatureDemoFlags
from nxdplug.plugin_api import NxdPlugError, positive_int

# The on-device sampling settings, from the demo's sampling flags of the same names.
_SAMPLING_SETTINGS = (
    "do_sample",
    "top_k",
    "top_p",
    "temperature",
    "dynamic",
    "global_topk",
    "top_k_kernel_enabled",
    "sampling_dp_degree",
)


class SamplingDemoFlags(FeatureDemoFlags):
    TITLE = "on-device sampling"
    DEST = "top_k_kernel_enabled"

    def add_flags(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--on-device-sampling", help="sample inside the model", action="store_true"
        )
        group.add_argument("--global-topk", type=positive_int, metavar="N")
        group.add_argument("--dynamic", help="per-request sampling parameters", action="store_true")
        group.add_argument(
            "--top-k-kernel-enabled", help="Neuron top-k kernel", action="store_true"
        )
        group.add_argument("--sampling-dp-degree", type=positive_int, metavar="N")

    def settings(self, args: argparse.Namespace) -> dict[str, Any]:
        if not args.on_device_sampling:
            given = {
                "--global-topk": args.global_topk,
                "--top-k-kernel-enabled": args.top_k_kernel_enabled or None,
                "--sampling-dp-degree": args.sampling_dp_degree,
            }
            named = [flag for flag, value in given.items() if value is not None]
            if named:
                raise NxdPlugError(f"{', '.join(named)} need(s) --on-device-sampling")
            return {}
        from nxdplug.plugin_api import OnDeviceSamplingConfig

        values = {name: getattr(args, name, None) for name in _SAMPLING_SETTINGS}
        settings = {name: value for name, value in values.items() if value is not None}
        return {"on_device_sampling_config": OnDeviceSamplingConfig(**settings)}
