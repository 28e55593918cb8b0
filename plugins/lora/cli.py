"""Multi-LoRA on the command line, with inference_demo's flags: ``--lora-ckpt-paths ID=PATH``
(or ``--lora-ckpt-json``), ``--max-loras``, ``--max-lora-rank``, ``--enable-dynamic-multi-lora``,
``--max-cpu-loras`` make the ``lora_config``;
``--adapter-ids`` gives each prompt's adapter (``none`` for the base model)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nxdplug.plugin_api import GENERIC_NEURON_CONFIG_DEST, NxdPlugError, positive_int

if TYPE_CHECKING:
    from pathlib import Path

    from torch import nn
    from transformers import PreTrainedModel

    from nxdplug.plugin_api import InferenceConfig, NeuronBaseForCausalLM

BASE_MODEL = "none"
RUNTIME_UPDATING_VARIABLE = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
TRUE = ("1", "true", "yes")


def _id_and_path(text: str) -> tuple[str, str]:
    adapter_id, sep, path = text.partition("=")
    if not sep or not adapter_id or not path:
        raise argparse.ArgumentTypeError(
            f"expected ID=PATH (e.g. code=adapters/code); got {text!r}"
        )
    return adapter_id, path


def _route_settings(args: argparse.Namespace, from_environment: bool = True) -> dict[str, Any]:
    """The adapter routes' opt-in and allowed folders (serve only); ``from_environment``:
    the opt-in may come from vLLM's variable."""
    opt_in = getattr(args, "allow_runtime_lora_updating", None)
    environment = os.environ.get(RUNTIME_UPDATING_VARIABLE, "").lower() in TRUE
    if opt_in is None and from_environment and environment:
        opt_in = True
    settings: dict[str, Any] = {}
    if opt_in:
        settings["allow_runtime_lora_updating"] = True
    if getattr(args, "allowed_lora_paths", None):
        settings["allowed_lora_paths"] = list(args.allowed_lora_paths)
    return settings


class LoraCommandLine:
    def add_arguments(self, parser: argparse.ArgumentParser, command: str) -> None:
        group = parser.add_argument_group("multi-LoRA", "PEFT adapters served per prompt.")
        # vLLM's name for the flag, where requests name an adapter as their model
        aliases = ("--lora-modules",) if command == "serve" else ()
        group.add_argument(
            "--lora-ckpt-paths",
            *aliases,
            nargs="+",
            type=_id_and_path,
            metavar="ID=PATH",
            help="adapters to serve: an id and a PEFT adapter folder each"
            + (" (a request names one by its id as its model)" if aliases else ""),
        )
        group.add_argument("--lora-ckpt-json", metavar="FILE", help="adapters listed in a file")
        group.add_argument("--max-loras", type=positive_int, metavar="N")
        group.add_argument("--max-lora-rank", type=positive_int, metavar="N")
        group.add_argument(
            "--enable-dynamic-multi-lora",
            action="store_true",
            help="adapters loaded and unloaded at run time (serve: /v1/load_lora_adapter), "
            "taking turns in the --max-loras slots",
        )
        group.add_argument(
            "--max-cpu-loras", type=positive_int, metavar="N", help="adapters held on the host"
        )
        if command == "serve":
            group.add_argument(
                "--allow-runtime-lora-updating",
                action="store_true",
                default=None,
                help="open /v1/load_lora_adapter and /v1/unload_lora_adapter (with "
                "--enable-dynamic-multi-lora and --allowed-lora-paths; "
                f"or {RUNTIME_UPDATING_VARIABLE}=true)",
            )
            group.add_argument(
                "--allowed-lora-paths",
                nargs="+",
                metavar="DIR",
                help="the folders /v1/load_lora_adapter may read adapters from (links and "
                "'..' resolved first)",
            )
        if command in ("run", "benchmark"):
            group.add_argument(
                "--adapter-ids",
                nargs="+",
                metavar="ID",
                help=f"each prompt's (batch row's) adapter id ({BASE_MODEL!r} for the base model)",
            )

    def neuron_config_kwargs(self, args: argparse.Namespace) -> dict[str, Any]:
        paths = getattr(args, "lora_ckpt_paths", None)
        listing = getattr(args, "lora_ckpt_json", None)
        dynamic = getattr(args, "enable_dynamic_multi_lora", False)
        if paths is None and listing is None and not dynamic:
            return _route_settings(args, from_environment=False)  # refused: without effect
        from nxdplug.plugin_api import LoraServingConfig

        settings: dict[str, Any] = {"lora_ckpt_paths": dict(paths) if paths else None}
        settings["lora_ckpt_json"] = listing
        settings["max_loras"] = args.max_loras or len(paths or ()) or 1
        if args.max_lora_rank is not None:
            settings["max_lora_rank"] = args.max_lora_rank
        if dynamic:
            settings["enable_dynamic_multi_lora"] = True
        if args.max_cpu_loras is not None:
            settings["max_cpu_loras"] = args.max_cpu_loras
        # As inference_demo: the adapters are served on a quantized base when it is quantized.
        given = dict(getattr(args, GENERIC_NEURON_CONFIG_DEST, None) or ())
        settings["base_model_quantized"] = given.get("quantized") is True
        return {"lora_config": LoraServingConfig(**settings)} | _route_settings(args)

    def prepare_config(self, args: argparse.Namespace, config: InferenceConfig) -> None:
        mode = getattr(args, "check_accuracy_mode", "skip")
        if getattr(args, "adapter_ids", None) and mode != "skip":
            raise NxdPlugError(
                f"--check-accuracy-mode {mode} compares with HF transformers without adapters; "
                "use skip with --adapter-ids (the test suite checks adapters against PEFT)"
            )

    def generate_keywords(
        self, args: argparse.Namespace, model: NeuronBaseForCausalLM
    ) -> dict[str, Any]:
        ids = getattr(args, "adapter_ids", None)
        if not ids:
            return {}
        return {"adapter_ids": [None if i == BASE_MODEL else i for i in ids]}

    def hf_comparison(
        self,
        args: argparse.Namespace,
        model: NeuronBaseForCausalLM,
        load_hf_model: Callable[[Path], PreTrainedModel],
    ) -> tuple[nn.Module, dict[str, Any]]:
        """PEFT on HF transformers with every served adapter, each row on its own
        (``adapter_names``, PEFT's mixed batch)."""
        from peft import PeftModel

        from nxdplug.plugins.lora.store import adapter_store

        paths = adapter_store(model).paths
        if not paths:
            raise NxdPlugError("--compare-hf with multi-LoRA needs at least one adapter")
        names = iter(paths)
        first = next(names)
        peft_model = PeftModel.from_pretrained(
            load_hf_model(args.model_path), str(paths[first]), adapter_name=first
        )
        for adapter_id in names:
            peft_model.load_adapter(str(paths[adapter_id]), adapter_name=adapter_id)
        rows = self.generate_keywords(args, model).get("adapter_ids")
        batch = model.neuron_config.batch_size
        adapter_names = [row or "__base__" for row in rows] if rows else ["__base__"] * batch
        return peft_model.eval(), {"adapter_names": adapter_names}
