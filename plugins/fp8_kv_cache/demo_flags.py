"""inference_demo's KV-cache quantization flags, for ``nxdplug inference_demo``: accepted for
what the fp8 KV cache does (one scale per tensor, float8_e4m3fn, cast directly), refused
otherwise."""

from __future__ import annotations

import argparse
from typing import Any

from nxdplug.nxdi.demo.flags import FeatureDemoFlags, only
from nxdplug.plugin_api import NxdPlugError

_PER_TENSOR = "per_tensor_symmetric"


class Fp8KvCacheDemoFlags(FeatureDemoFlags):
    TITLE = "KV-cache quantization"
    DEST = "kv_direct_cast"

    def add_flags(self, group: argparse._ArgumentGroup) -> None:
        why = "the fp8 KV cache has one scale per tensor"
        for flag in ("--k-quant-method", "--v-quant-method"):
            group.add_argument(flag, type=only(_PER_TENSOR, str, why), default=_PER_TENSOR)
        dtype_why = "the KV cache is stored as float8_e4m3fn"
        group.add_argument(
            "--kv-quant-dtype", type=only("float8_e4m3fn", str, dtype_why), default="float8_e4m3fn"
        )
        group.add_argument(
            "--kv-direct-cast",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="cast K and V to fp8 without scaling (--no-kv-direct-cast is not supported)",
        )

    def settings(self, args: argparse.Namespace) -> dict[str, Any]:
        if not args.kv_direct_cast:
            raise NxdPlugError(
                "--no-kv-direct-cast is not supported: the fp8 KV cache casts directly, or "
                "scales by the kv_cache_scales setting"
            )
        return {}
