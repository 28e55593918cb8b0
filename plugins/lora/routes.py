"""vLLM's runtime adapter routes, for ``nxdplug serve`` with dynamic multi-LoRA: ``POST
/v1/load_lora_adapter`` with ``{"lora_name", "lora_path"}`` registers a PEFT adapter (it takes a
slot when a request first names it as its model), ``POST /v1/unload_lora_adapter`` with
``{"lora_name"}`` forgets one that no waiting or running request uses. Both run between the
engine's steps (``ServingRoute``), so a step never sees an adapter half written, and through
``Engine.apply_to_model``, so that every tensor-parallel rank loads (or forgets) its part."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nxdplug.errors import NxdPlugError

KEYWORD = "adapter_ids"
STORE = "nxdplug.plugins.lora.store"


def load_lora_adapter(engine: Any, body: Mapping[str, Any]) -> dict[str, Any]:
    name, path = _text(body, "lora_name"), _text(body, "lora_path")
    engine.apply_to_model(f"{STORE}:load_adapter", name, path)
    return {"object": "lora_adapter", "id": name, "status": "loaded"}


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
