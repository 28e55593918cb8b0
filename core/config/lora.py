"""Multi-LoRA serving settings (``NeuronConfig.lora_config``)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import attrs

from nxdplug.errors import ConfigError

ADAPTER_CONFIG_FILE = "adapter_config.json"


@attrs.define(kw_only=True)
class LoraServingConfig:
    """Which LoRA adapters to serve and how they are laid out; setting it enables multi-LoRA.

    Adapters are given either as ``lora_ckpt_paths`` / ``lora_ckpt_paths_cpu`` (adapter id ->
    checkpoint path, in device and host memory) or as ``lora_ckpt_json``, a JSON file with the
    keys ``lora-ckpt-dir``, ``lora-ckpt-paths`` and ``lora-ckpt-paths-cpu``. ``max_cpu_loras``
    defaults to 100, as in NxD Inference's source. ``max_lora_rank`` and ``target_modules`` are
    not in the NxD Inference reference but are needed to size and place the adapters (as in its
    source).

    The rest of NxD Inference's signature is accepted too: ``dynamic_multi_lora`` (its source's
    name for ``enable_dynamic_multi_lora``, which defaults to it), ``batch_size`` (the rows
    whose adapters one step gathers: every row has its own here), ``eviction_policy`` and
    ``lfu_decay_period`` (which host adapter leaves first), ``is_context_encoding`` (set per
    sub-model by NxD Inference itself), ``enable_base_model_only`` (a slot for rows served by
    the base model: slot 0 always is). ``lora_bias`` other than ``"none"`` would change
    results and is refused until implemented.

    As NxD Inference's, construction reads the adapters' ``adapter_config.json``: ``max_loras``
    rises to the number of adapters in ``lora_ckpt_paths`` (without dynamic multi-LoRA),
    ``max_lora_rank`` to the largest rank (PEFT's ``r``) and ``target_modules`` to the union of
    theirs, each with a warning. With dynamic multi-LoRA, more adapters listed (in slots or on
    the host) than ``max_cpu_loras`` is NxD Inference's ValueError. An adapter whose config
    cannot be read is left to validation, which names it.
    """

    max_loras: int = 1
    max_cpu_loras: int = 100
    max_lora_rank: int = 16
    target_modules: list[str] | None = None
    dynamic_multi_lora: bool = False
    enable_dynamic_multi_lora: bool = attrs.field(
        default=attrs.Factory(lambda self: self.dynamic_multi_lora, takes_self=True)
    )
    lora_ckpt_paths: dict[str, str] | list[str] | None = None
    lora_ckpt_paths_cpu: dict[str, str] | list[str] | None = None
    lora_ckpt_json: str | None = None
    lora_memory_transpose: bool = True
    lora_shard_linear_layer: bool = True
    base_model_quantized: bool = False
    batch_size: int = 1
    lora_bias: str = "none"
    is_context_encoding: bool = False
    eviction_policy: str = "lru"
    lfu_decay_period: int = 128
    enable_base_model_only: bool = False

    def __attrs_post_init__(self) -> None:
        self._fit_to_adapters()

    def adapter_paths(self, on_host: bool = False) -> dict[str, Path]:
        """Adapter id -> folder of the adapters loaded into slots at start-up
        (``lora_ckpt_paths``), or with ``on_host`` of those held on the host
        (``lora_ckpt_paths_cpu``); from the ``lora_ckpt_json`` file (``lora-ckpt-paths``,
        ``lora-ckpt-paths-cpu``) when it is set."""
        if self.lora_ckpt_json is None:
            given = self.lora_ckpt_paths_cpu if on_host else self.lora_ckpt_paths
            return {name: Path(path) for name, path in _by_id(given).items()}
        source = Path(self.lora_ckpt_json)
        try:
            listing = json.loads(source.read_text())
            folder = Path(listing.get("lora-ckpt-dir", source.parent))
            key = "lora-ckpt-paths-cpu" if on_host else "lora-ckpt-paths"
            paths = listing.get(key, {}) if on_host else listing[key]
            return {name: folder / path for name, path in paths.items()}
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise ConfigError(
                [
                    f"lora_ckpt_json {source}: expected a JSON object with 'lora-ckpt-paths' "
                    "(adapter id -> path), and optionally 'lora-ckpt-paths-cpu' and "
                    f"'lora-ckpt-dir' ({type(exc).__name__}: {exc})"
                ]
            ) from exc

    def _fit_to_adapters(self) -> None:
        try:
            device, host = self.adapter_paths(), self.adapter_paths(on_host=True)
        except ConfigError:
            return  # validation reports the file
        if self.enable_dynamic_multi_lora:
            self._check_host_room(len(device | host))
        # With dynamic multi-LoRA the adapters beyond max_loras wait for a slot instead.
        if len(device) > self.max_loras and not self.enable_dynamic_multi_lora:
            _say(f"max_loras raised from {self.max_loras} to {len(device)}, the adapters given")
            self.max_loras = len(device)
        settings = [s for s in map(_adapter_settings, (device | host).values()) if s]
        ranks = [rank for rank, _ in settings if isinstance(rank, int)]
        if ranks and max(ranks) > self.max_lora_rank:
            _say(f"max_lora_rank raised from {self.max_lora_rank} to {max(ranks)}, the largest")
            self.max_lora_rank = max(ranks)
        trained = list(dict.fromkeys(name for _, names in settings for name in names))
        if trained and not set(trained) <= set(self.target_modules or ()):
            union = list(dict.fromkeys([*(self.target_modules or ()), *trained]))
            _say(f"target_modules set to {union}, the modules the adapters train")
            self.target_modules = union

    def _check_host_room(self, listed: int) -> None:
        """Every adapter listed is held on the host, the slots' ones too (NxD Inference's
        ``lora_ckpt_paths_cpu`` holds both)."""
        if listed > self.max_cpu_loras:
            where = self.lora_ckpt_json or "lora_ckpt_paths and lora_ckpt_paths_cpu"
            raise HostAdapterCountError(
                [
                    f"The total number of LoRA checkpoints specified in {where} is {listed}, but "
                    "the maximum number of adapters that can be hosted on CPU is "
                    f"{self.max_cpu_loras}: raise max_cpu_loras, or list fewer adapters"
                ]
            )


class HostAdapterCountError(ConfigError, ValueError):
    """More adapters listed than ``max_cpu_loras``: the ValueError NxD Inference raises."""


def _by_id(given: dict[str, str] | list[str] | None) -> dict[str, str]:
    """Adapter id -> path, from a dict or NxD Inference's list of ``"id : path"`` entries."""
    if given is None or isinstance(given, dict):
        return dict(given or {})
    entries = {}
    for entry in given:
        adapter_id, colon, path = str(entry).partition(":")
        if not colon or not adapter_id.strip() or not path.strip():
            raise ConfigError([f"lora_ckpt_paths entry {entry!r}: expected 'ADAPTER_ID : PATH'"])
        entries[adapter_id.strip()] = path.strip()
    return entries


def _adapter_settings(folder: Path) -> tuple[Any, list[str]] | None:
    """(rank, target modules) of a PEFT adapter folder; None when its config is unreadable."""
    try:
        settings = json.loads((folder / ADAPTER_CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(settings, dict):
        return None
    targets = settings.get("target_modules")
    return settings.get("r"), targets if isinstance(targets, list) else []


def _say(change: str) -> None:
    """Warn at the line that built the config (past the fitting and attrs' ``__init__``)."""
    warnings.warn(f"LoraServingConfig: {change} (as NxD Inference does)", stacklevel=5)
