"""inference_demo's feature flags, with its names, defaults and meanings; one group per feature.

Each group adds its flags and turns them into NeuronConfig settings. Destinations that another
command-line extension also reads (the LoRA plugin's ``lora_ckpt_paths``) get their own names,
so that each extension sees only its own flags; ``--adapter-id`` fills ``adapter_ids``, which the
LoRA plugin's extension turns into each row's adapter.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from nxdplug.cli.inference_demo_flags import RefusedFlag, load_json_file, only
from nxdplug.cli.options import positive_int
from nxdplug.errors import NxdPlugError

_TRUE = {"action": "store_true"}
_PER_TENSOR = "per_tensor_symmetric"


def _lora_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--enable-lora", help="serve LoRA adapters", **_TRUE)
    group.add_argument(
        "--enable-dynamic-multi-lora", help="swap adapters in from host memory", **_TRUE
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


def _lora_config(args: argparse.Namespace) -> dict[str, Any]:
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
    from nxdplug.config import LoraServingConfig

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


def _sampling_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--on-device-sampling", help="sample inside the model", **_TRUE)
    group.add_argument("--global-topk", type=positive_int, metavar="N")
    group.add_argument("--dynamic", help="per-request sampling parameters", **_TRUE)
    group.add_argument("--top-k-kernel-enabled", help="Neuron top-k kernel", **_TRUE)
    group.add_argument("--sampling-dp-degree", type=positive_int, metavar="N")


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


def _sampling_config(args: argparse.Namespace) -> dict[str, Any]:
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
    from nxdplug.config import OnDeviceSamplingConfig

    values = {name: getattr(args, name, None) for name in _SAMPLING_SETTINGS}
    settings = {name: value for name, value in values.items() if value is not None}
    return {"on_device_sampling_config": OnDeviceSamplingConfig(**settings)}


def _kv_cache_flags(group: argparse._ArgumentGroup) -> None:
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


def _kv_cache_config(args: argparse.Namespace) -> dict[str, Any]:
    if not args.kv_direct_cast:
        raise NxdPlugError(
            "--no-kv-direct-cast is not supported: the fp8 KV cache casts directly, or scales "
            "by the kv_cache_scales setting"
        )
    return {}


def _quantization_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--activation-quantization-type",
        nargs="*",
        action=RefusedFlag,
        help="activation quantization is not implemented",
    )
    why = "activations are not quantized, so nothing is clamped"
    group.add_argument("--quantize-clamp-bound", type=only(math.inf, float, why), default=math.inf)


def _medusa_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--medusa-tree-json", dest="demo_medusa_tree", type=load_json_file, metavar="FILE"
    )


def _medusa_config(args: argparse.Namespace) -> dict[str, Any]:
    return {} if args.demo_medusa_tree is None else {"medusa_tree": args.demo_medusa_tree}


def _eagle_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--is-eagle3", nargs=0, action=RefusedFlag, help="EAGLE-3 drafts are not implemented"
    )


def _none(args: argparse.Namespace) -> dict[str, Any]:
    return {}


# title -> (add the flags, NeuronConfig settings from them)
GROUPS: dict[
    str,
    tuple[
        Callable[[argparse._ArgumentGroup], None],
        Callable[[argparse.Namespace], dict[str, Any]],
    ],
] = {
    "LoRA adapters": (_lora_flags, _lora_config),
    "on-device sampling": (_sampling_flags, _sampling_config),
    "KV-cache quantization": (_kv_cache_flags, _kv_cache_config),
    "quantization": (_quantization_flags, _none),
    "Medusa": (_medusa_flags, _medusa_config),
    "EAGLE": (_eagle_flags, _none),
}


class FeatureFlags:
    """The ``cli_extensions`` implementation: every group's flags and settings."""

    def add_arguments(self, parser: argparse.ArgumentParser, command: str) -> None:
        for title, (add_flags, _) in GROUPS.items():
            add_flags(parser.add_argument_group(title))

    def neuron_config_kwargs(self, args: argparse.Namespace) -> dict[str, Any]:
        if not hasattr(args, "demo_medusa_tree"):  # another command's arguments
            return {}
        settings: dict[str, Any] = {}
        for _, to_settings in GROUPS.values():
            settings |= to_settings(args)
        return settings

    def prepare_config(self, args: argparse.Namespace, config: Any) -> None:
        """The settings are complete once made."""

    def generate_keywords(self, args: argparse.Namespace, model: Any) -> dict[str, Any]:
        return {}  # --adapter-id reaches generate() through the LoRA plugin's extension

    def hf_comparison(
        self, args: argparse.Namespace, model: Any, load_hf_model: Callable[[Any], Any]
    ) -> None:
        return None
