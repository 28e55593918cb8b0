"""Multi-LoRA (``lora_config=LoraServingConfig(...)``): PEFT LoRA adapters, one per row.

The adapters named by ``lora_ckpt_paths`` (or ``lora_ckpt_json``) are read at build time into
fixed slots: slot 0 is "no adapter", slot i the i-th adapter. Every target projection (q/k/v/o,
gate/up/down) gets stacked low-rank weights ``lora_a`` [slots, rank, in] and ``lora_b``
[slots, rank, out] (or [slots, out, rank] with ``lora_memory_transpose=False``) beside its own
weight, written by a state-dict converter, so they are graph weights like any other. Each row's
slot is a step input (``adapter_ids``), and the projection adds ``x A[slot]^T B[slot]^T *
scale[slot]`` for the whole batch, in two batched matmuls or, for one token per row, two sums
over each row's slot.
"""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import CliExtension, Feature, StateDictConverter, StepInput, hookimpl
from nxdplug.plugins.serve.records import ServingRoute

NXDPLUG_API_VERSION = 2

ENABLED_BY = ("lora_config",)
# The server's opt-in to the adapter routes (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), and the
# folders they may read adapters from: what the server allows, not what the graphs are.
ROUTE_SETTINGS = {"allow_runtime_lora_updating": False, "allowed_lora_paths": None}
ROUTES_ENABLED_BY = ("allow_runtime_lora_updating",)
PACKAGE = "nxdplug.plugins.lora"


@hookimpl
def nxdplug_features() -> Iterable[Feature]:
    yield Feature(
        name="multi-lora",
        enabled_by=ENABLED_BY,
        validate=f"{PACKAGE}.adapters:validate",
        transform_model=f"{PACKAGE}.layers:add_lora_weights",
        settings=ROUTE_SETTINGS,
        runtime_settings=tuple(ROUTE_SETTINGS),
        description="PEFT LoRA adapters in fixed slots, chosen per row by adapter_ids",
    )


@hookimpl
def nxdplug_step_inputs() -> Iterable[StepInput]:
    yield StepInput(
        name="adapter-ids",
        enabled_by=ENABLED_BY,
        builder=f"{PACKAGE}.layers:AdapterSlots",
        inputs=("adapter_ids",),
        keywords=("adapter_ids",),
        description="each row's adapter slot (0: the base model)",
    )


@hookimpl
def nxdplug_state_dict_converters() -> Iterable[StateDictConverter]:
    yield StateDictConverter(
        name="lora-adapters",
        converter=f"{PACKAGE}.layout:add_adapter_weights",
        enabled_by=ENABLED_BY,
        order=190,
        description="the adapters' A and B matrices stacked per target projection",
    )


@hookimpl
def nxdplug_cli_extensions() -> Iterable[CliExtension]:
    yield CliExtension(
        name="multi-lora",
        implementation=f"{PACKAGE}.cli:LoraCommandLine",
        enabled_by=ENABLED_BY,
        commands=("run", "benchmark", "compile", "check-config", "serve"),
        description="--lora-ckpt-paths ID=PATH (serve: also vLLM's --lora-modules), --max-loras, "
        "--max-lora-rank, --adapter-ids",
    )
    yield CliExtension(
        name="multi-lora-inference-demo",
        implementation="nxdplug.plugins.lora.demo_flags:LoraDemoFlags",
        commands=("inference_demo",),
        description="inference_demo's LoRA flags (--enable-lora, --lora-ckpt-path, ...)",
    )


@hookimpl(optionalhook=True)  # a hook of the serve plugin
def nxdplug_serving_routes() -> Iterable[ServingRoute]:
    yield ServingRoute(
        name="load-lora-adapter",
        path="/v1/load_lora_adapter",
        handler=f"{PACKAGE}.routes:load_lora_adapter",
        enabled_by=ROUTES_ENABLED_BY,
        description="vLLM's runtime adapter loading (dynamic multi-LoRA)",
    )
    yield ServingRoute(
        name="unload-lora-adapter",
        path="/v1/unload_lora_adapter",
        handler=f"{PACKAGE}.routes:unload_lora_adapter",
        enabled_by=ROUTES_ENABLED_BY,
        description="vLLM's runtime adapter unloading (dynamic multi-LoRA)",
    )
