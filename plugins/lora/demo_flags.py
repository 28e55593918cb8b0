"""inference_demo's LoRA flags, for ``nxdplug inference_demo``: ``--enable-lora`` ... make the
``lora_config``.

``--lora-ckpt-path`` and its kin get their own destinations, so that the plugin's other
extension (:mod:`nxdplug.plugins.lora.cli`, reading ``lora_ckpt_paths``) sees only its own
flags; ``--adapter-id`` fills ``adapter_ids``, which that extension turns into each row's
adapter (and passes to ``generate()``).
"""

from __future__ import annotations

import argparse
from typing import Any

from nxdplug.nxdi.demo.flags import FeatureDemoFlags
from nxdplug.plugin_api import NxdPlugError, positive_int


def _adapter_paths(entries: list[str] | None) -> dict[str, str] | None:
    """inference_demo's ``ID : PATH`` entries as a dict."""
    if entries is None:
        return None
    paths = {}
    for entry in entries:
        adapter_id, sep, path = entry.partition(":")
        if not sep or not adapter_id.strip() or not path.strip():
            raise NxdPlugError(f"--lora-ckpt-path expects 'ID : PATH'; got {entry!r}")
        paths[adapter_id.strip()] = path.strip()
    return paths


class LoraDemoFlags(FeatureDemoFlags):
    TITLE = "LoRA adapters"
    DEST = "demo_lora_ckpt_json"

    def add_flags(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--enable-lora", help="serve LoRA adapters", action="store_true")
        group.add_argument(
            "--enable-dynamic-multi-lora",
            help="swap adapters in from host memory",
            action="store_true",
        )
        group.add_argument("--max-loras", type=positive_int, default=1, metavar="N")
        group.add_argument("--max-lora-rank", type=positive_int, default=16, metavar="N")
        group.add_argument("--target-modules", nargs="+", metavar="NAME")
        group.add_argument("--max-cpu-loras", type=positive_int, metavar="N")
        for flag, dest in (
            ("--lora-ckpt-path", "demo_lora_ckpt_paths"),
            ("--lora-ckpt-path-cpu", "demo_lora_ckpt_paths_cpu"),
        ):
            group.add_argument(flag, dest=dest, action="append", metavar="'ID : PATH'")
        group.add_argument("--lora-ckpt-json", dest="demo_lora_ckpt_json", metavar="FILE")
        group.add_argument(
            "--adapter-id",
            dest="adapter_ids",
            action="append",
            metavar="ID",
            help="a prompt's adapter, once per prompt ('none': the base model)",
        )

    def settings(self, args: argparse.Namespace) -> dict[str, Any]:
        given = {
            "--lora-ckpt-path": args.demo_lora_ckpt_paths,
            "--lora-ckpt-path-cpu": args.demo_lora_ckpt_paths_cpu,
            "--lora-ckpt-json": args.demo_lora_ckpt_json,
            "--target-modules": args.target_modules,
            "--max-cpu-loras": args.max_cpu_loras,
            "--adapter-id": args.adapter_ids,
        }
        if not (args.enable_lora or args.enable_dynamic_multi_lora):
            named = [flag for flag, value in given.items() if value is not None]
            if named:
                raise NxdPlugError(f"{', '.join(named)} need(s) --enable-lora")
            return {}
        from nxdplug.plugin_api import LoraServingConfig

        settings = {
            "max_loras": args.max_loras,
            "max_lora_rank": args.max_lora_rank,
            "target_modules": args.target_modules,
            "lora_ckpt_paths": _adapter_paths(args.demo_lora_ckpt_paths),
            "lora_ckpt_paths_cpu": _adapter_paths(args.demo_lora_ckpt_paths_cpu),
            "lora_ckpt_json": args.demo_lora_ckpt_json,
            "dynamic_multi_lora": args.enable_dynamic_multi_lora,
            "base_model_quantized": bool(getattr(args, "quantized", False)),
        }
        if args.max_cpu_loras is not None:
            settings["max_cpu_loras"] = args.max_cpu_loras
        return {"lora_config": LoraServingConfig(**settings)}
