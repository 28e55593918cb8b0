"""vLLM's runtime adapter routes, for ``nxdplug serve`` with dynamic multi-LoRA: ``POST
/v1/load_lora_adapter`` with ``{"lora_name", "lora_path"}`` registers a PEFT adapter (it takes a
slot when a request first names it as its model), ``POST /v1/unload_lora_adapter`` with
``{"lora_name"}`` forgets one that no waiting or running request uses. They exist only with the
server's opt-in (``--allow-runtime-lora-updating``, as vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``)
and read adapters only under the folders it allows (``--allowed-lora-paths``). Both run between the
engine's steps (``ServingRoute``), so a step never sees an adapter half written, and through
``Engine.apply_to_model``, so that every tensor-parallel rank loads (or forgets) its part."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nxdplug.plugin_api import NxdPlugError

if TYPE_CHECKING:
    from nxdplug.plugin_api import NeuronConfig

KEYWORD = "adapter_ids"
STORE = "nxdplug.plugins.lora.store"


def load_lora_adapter(engine: Any, body: Mapping[str, Any]) -> dict[str, Any]:
    name = _text(body, "lora_name")
    path = allowed_path(_text(body, "lora_path"), engine.application.neuron_config)
    engine.apply_to_model(f"{STORE}:load_adapter", name, str(path))
    return {"object": "lora_adapter", "id": name, "status": "loaded"}


def allowed_path(given: str, neuron_config: NeuronConfig) -> Path:
    """``given`` with every link and ``..`` resolved, if that lies in one of the folders the
    server allows (``allowed_lora_paths``); the resolved path is the one read, so a link
    changed after this check cannot lead elsewhere."""
    path = Path(given).resolve()
    folders = [Path(folder).resolve() for folder in neuron_config.allowed_lora_paths]
    if not any(path.is_relative_to(folder) for folder in folders):
        raise NxdPlugError(
            f"lora_path: {given} is not in a folder this server reads adapters from "
            "(--allowed-lora-paths)"
        )
    return path


def unload_lora_adapter(engine: Any, body: Mapping[str, Any]) -> dict[str, Any]:
    name = _text(body, "lora_name")
    users = [r for r in engine.unfinished_requests() if r.step_keywords.get(KEYWORD) == name]
    if users:
        raise NxdPlugError(
            f"adapter {name!r} is used by {len(users)} waiting or running request(s); unload "
            "it once they end"
        )
    engine.apply_to_model(f"{STORE}:unload_adapter", name)
    return {"object": "lora_adapter", "id": name, "status": "unloaded"}


def _text(body: Mapping[str, Any], field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value:
        raise NxdPlugError(f"{field}: a non-empty string is required, got {value!r}")
    return value
