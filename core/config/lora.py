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
    defaults to ``max_loras``. ``max_lora_rank`` and ``target_modules`` are not in the NxD
    Inference reference but are needed to size and place the adapters (as in its source).

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
    theirs, each with a warning. An adapter whose config cannot be read is left to validation,
    which names it.
    """

    max_loras: int = 1
    max_cpu_loras: int = attrs.field(
        default=attrs.Factory(lambda self: self.max_loras, takes_self=True)
    )
    max_lora_rank: int = 16
    target_modules: list[str] | None = None
    dynamic_multi_lora: bool = False
    enable_dynamic_multi_lora: bool = attrs.field(
        default=attrs.Factory(lambda self: self.dynamic_multi_lora, takes_self=True)
    )
    lora_ckpt_paths: dict[str, str] | None = None
    lora_ckpt_paths_cpu: dict[str, str] | None = None
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
            return {name: Path(path) for name, path in (given or {}).items()}
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
    warnings.warn(f"LoraServingConfig: {change} (as NxD Inference does)", stacklevel=4)
