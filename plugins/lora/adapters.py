"""PEFT LoRA adapters: where they are, what they hold, and what the config allows of them.

An adapter is a PEFT folder: ``adapter_config.json`` and ``adapter_model.safetensors`` (or
``adapter_model.bin``, read with ``weights_only``). Each adapter's rank and alpha are its own;
``use_rslora`` scales by ``alpha / sqrt(rank)`` instead of ``alpha / rank``. Every problem of
every adapter is reported at once, naming the adapter, before anything is built. How their
matrices are laid out in the model is :mod:`nxdplug.plugins.lora.layout`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch

from nxdplug.plugin_api import CheckpointError, ConfigError, load_tensor_file

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, NeuronConfig, PipelineContext, PluginSelection

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# A PEFT key (any prefix) -> the projection's name in nxdplug's model and which matrix.
_PEFT_KEY = re.compile(
    r"(layers\.\d+\.[\w.]*?\b(?:" + "|".join(TARGETS) + r"))\.lora_([AB])\.weight$"
)
# adapter_config.json settings that change what an adapter computes, and their neutral values.
_UNSUPPORTED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}


@attrs.frozen
class Adapter:
    """One adapter as its config describes it."""

    adapter_id: str
    path: Path
    rank: int
    scale: float
    targets: tuple[str, ...]


def read_adapter(adapter_id: str, path: Path) -> Adapter:
    """The adapter at ``path``; a CheckpointError naming every problem of it."""
    where = f"LoRA adapter {adapter_id!r} ({path})"
    try:
        settings = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{where}: no readable {CONFIG_FILE} ({type(exc).__name__}: {exc}); give the folder "
            "PEFT's save_pretrained wrote"
        ) from exc
    problems = []
    if settings.get("peft_type") != "LORA":
        problems.append(f"peft_type is {settings.get('peft_type')!r}; only LORA adapters serve")
    if settings.get("bias", "none") != "none":
        problems.append(f"bias is {settings['bias']!r}: trained biases are not served")
    problems += [
        f"{name}={settings[name]!r} is not supported; adapters without it serve"
        for name, neutral in _UNSUPPORTED.items()
        if settings.get(name, neutral) not in (neutral, None, {}, [])
    ]
    targets = settings.get("target_modules")
    if not isinstance(targets, list):
        problems.append(f"target_modules is {targets!r}; give the list of projections it trains")
        targets = []
    problems += [
        f"it trains {name!r}, which is not served; LoRA applies to {', '.join(TARGETS)}"
        for name in targets
        if name not in TARGETS
    ]
    rank, alpha = settings.get("r"), settings.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        problems.append(f"r ({rank!r}) and lora_alpha ({alpha!r}) must be numbers, r >= 1")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        problems.append(f"it has no {' or '.join(WEIGHT_FILES)}")
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))
    scale = alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)
    ordered = tuple(name for name in TARGETS if name in targets)
    return Adapter(adapter_id, path, rank, scale, ordered)


def adapters(config: InferenceConfig) -> list[Adapter]:
    """The configured adapters in slot order (slot i + 1 is the i-th)."""
    return [
        read_adapter(i, path)
        for i, path in config.neuron_config.lora_config.adapter_paths().items()
    ]


def slot_count(config: InferenceConfig) -> int:
    """Slots per projection: ``max_loras`` adapters and slot 0, the base model."""
    return config.neuron_config.lora_config.max_loras + 1


def slots(config: InferenceConfig) -> dict[str, int]:
    """The adapters in a slot at start-up: the first ``max_loras`` listed, in slots 1, 2, ...;
    slot 0 is the base model."""
    lora_config = config.neuron_config.lora_config
    listed = list(lora_config.adapter_paths())[: lora_config.max_loras]
    return {adapter_id: slot for slot, adapter_id in enumerate(listed, start=1)}


def targets(config: InferenceConfig) -> tuple[str, ...]:
    """The projections that carry LoRA weights: ``target_modules``; else, with dynamic loading,
    every projection an adapter may train, and without it every one a listed adapter trains."""
    lora_config = config.neuron_config.lora_config
    if lora_config.target_modules:
        return tuple(name for name in TARGETS if name in lora_config.target_modules)
    if lora_config.enable_dynamic_multi_lora:
        return TARGETS
    trained = {name for adapter in adapters(config) for name in adapter.targets}
    return tuple(name for name in TARGETS if name in trained)


def _route_problems(neuron_config: NeuronConfig) -> list[str]:
    """The adapter routes' opt-in needs dynamic multi-LoRA and the folders they may read."""
    allowed = getattr(neuron_config, "allowed_lora_paths", None)
    if not getattr(neuron_config, "allow_runtime_lora_updating", False):
        if allowed:
            return [
                "allowed_lora_paths (--allowed-lora-paths) are read by the adapter routes, which "
                "only allow_runtime_lora_updating (--allow-runtime-lora-updating) opens"
            ]
        return []
    problems = []
    if not neuron_config.lora_config.enable_dynamic_multi_lora:
        problems.append(
            "allow_runtime_lora_updating opens /v1/load_lora_adapter, which loads adapters into "
            "the slots at run time: set enable_dynamic_multi_lora (--enable-dynamic-multi-lora)"
        )
    if not allowed:
        problems.append(
            "allow_runtime_lora_updating needs allowed_lora_paths (--allowed-lora-paths DIR): "
            "the folders /v1/load_lora_adapter may read adapters from, so that a client cannot "
            "make the server read any path on its disk"
        )
    for folder in allowed or ():
        if not Path(folder).is_dir():
            problems.append(f"allowed_lora_paths: {folder} is not a folder")
    return problems


def validate(context: PipelineContext) -> list[str]:
    """The ``validate`` callback of the multi-lora feature: every problem at once."""
    neuron_config = context.neuron_config
    lora_config = neuron_config.lora_config
    problems = [
        f"{setting} with lora_config is not implemented yet; {fix}"
        for setting, fix in _not_yet(neuron_config, context.selection)
    ]
    if lora_config.base_model_quantized != bool(neuron_config.quantized):
        problems.append(_quantized_contradiction(neuron_config.quantized))
    problems += _route_problems(neuron_config)
    try:
        paths = lora_config.adapter_paths()
        host_paths = lora_config.adapter_paths(on_host=True)
    except ConfigError as exc:
        return problems + exc.problems
    if host_paths and not lora_config.enable_dynamic_multi_lora:
        problems.append(
            "lora_ckpt_paths_cpu holds adapters to swap into the slots at run time, which needs "
            "enable_dynamic_multi_lora=True; set it, or move them to lora_ckpt_paths"
        )
    both = sorted(set(paths) & set(host_paths))
    if both:
        problems.append(f"adapter ids {both} are in both lora_ckpt_paths and lora_ckpt_paths_cpu")
    if not paths and not lora_config.enable_dynamic_multi_lora:
        problems.append(
            "lora_config names no adapter: give lora_ckpt_paths={'id': 'path/to/peft/adapter'} "
            "or lora_ckpt_json"
        )
    if len(paths) > lora_config.max_loras and not lora_config.enable_dynamic_multi_lora:
        problems.append(
            f"lora_config names {len(paths)} adapters but max_loras is {lora_config.max_loras}; "
            "raise max_loras"
        )
    if lora_config.target_modules:
        problems += [
            f"lora_config.target_modules names {name!r}; LoRA applies to {', '.join(TARGETS)}"
            for name in lora_config.target_modules
            if name not in TARGETS
        ]
    for adapter_id, path in (paths | host_paths).items():
        try:
            adapter = read_adapter(adapter_id, path)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if adapter.rank > lora_config.max_lora_rank:
            problems.append(
                f"LoRA adapter {adapter_id!r} has rank {adapter.rank}, above max_lora_rank "
                f"({lora_config.max_lora_rank}); raise max_lora_rank"
            )
        untargeted = set(adapter.targets) - set(lora_config.target_modules or TARGETS)
        if untargeted:
            problems.append(
                f"LoRA adapter {adapter_id!r} trains {sorted(untargeted)}, which "
                "lora_config.target_modules leaves out; add them"
            )
    return problems


def _not_yet(neuron_config: NeuronConfig, selection: PluginSelection) -> Iterator[tuple[str, str]]:
    if selection.speculation_mode is not None:
        yield f"speculation ({selection.speculation_mode.name})", "turn speculation off"
    policy = neuron_config.lora_config.eviction_policy
    if policy != "lru":
        yield (
            f"eviction_policy={policy!r}",
            "host adapters are evicted least recently used first: set eviction_policy='lru'",
        )


def _quantized_contradiction(quantized: bool) -> str:
    """``base_model_quantized`` says what ``quantized`` says (NxD Inference's inference_demo
    sets one from the other): whether the base projections hold 8-bit weights, the adapters
    applied on top of them. Saying one thing in one and the other in the other is refused."""
    if quantized:
        return (
            "quantized=True quantizes the base model, but lora_config.base_model_quantized is "
            "False; set base_model_quantized=True to serve adapters on the quantized base "
            "weights (or quantized=False)"
        )
    return (
        "lora_config.base_model_quantized=True says the base model is quantized, but quantized "
        "is False; set quantized=True with quantized_checkpoints_path and quantization_dtype "
        "(or base_model_quantized=False)"
    )


def adapter_matrices(adapter: Adapter) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Projection name -> (A [rank, in], B [out, rank]) of one adapter, in float32."""
    file = next(adapter.path / name for name in WEIGHT_FILES if (adapter.path / name).is_file())
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_tensor_file(file).items():
        match = _PEFT_KEY.search(key)
        if match is None:
            raise CheckpointError(
                f"LoRA adapter {adapter.adapter_id!r}: {file} holds {key!r}, which is not a "
                "LoRA A or B matrix of a served projection"
            )
        halves.setdefault(match.group(1), {})[match.group(2)] = tensor.float()
    incomplete = sorted(name for name, pair in halves.items() if set(pair) != {"A", "B"})
    if incomplete:
        raise CheckpointError(
            f"LoRA adapter {adapter.adapter_id!r}: {file} lacks A or B for {incomplete}"
        )
    return {name: (pair["A"], pair["B"]) for name, pair in halves.items()}
