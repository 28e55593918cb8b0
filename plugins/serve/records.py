"""The records of ``nxdplug serve``'s own hooks (:mod:`nxdplug.plugins.serve.hookspecs`)."""

from __future__ import annotations

import re

import attrs

from nxdplug.plugin_api import PluginRecord, SelectableRecord, ref_field


def _check_path(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or not re.match(r"^(/[A-Za-z0-9_.\-]+)+$", value):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a URL path such as "
            f"'/v1/load_lora_adapter'; got {value!r}"
        )


@attrs.frozen(kw_only=True)
class ToolParser(PluginRecord):
    """Finds the tool calls a model writes in its reply, in the format its chat template taught
    it (Hermes' ``<tool_call>`` tags, Llama 3's bare JSON, ...), for ``nxdplug serve
    --enable-auto-tool-choice --tool-call-parser NAME`` (vLLM's flags).

    ``implementation`` is a class built with ``(tools)``, the request's tool definitions in
    OpenAI's form, once per reply; it follows
    :class:`nxdplug.serving.tool_calls.ToolCallParser`.
    """

    implementation: str = ref_field()


@attrs.frozen(kw_only=True)
class ReasoningParser(PluginRecord):
    """Tells a model's reasoning from its answer in a chat reply (Qwen3's and DeepSeek-R1's
    ``<think>...</think>``), for ``nxdplug serve --reasoning-parser NAME`` (vLLM's flag): the
    reasoning is answered as ``reasoning_content``.

    ``implementation`` is a class built with ``(prompt)``, the prompt's text (a chat template
    may open the thinking there), once per reply; it follows
    :class:`nxdplug.serving.reasoning.ReasoningSplitter`.
    """

    implementation: str = ref_field()


@attrs.frozen(kw_only=True)
class ServingRoute(SelectableRecord):
    """A ``POST`` route a feature adds to ``nxdplug serve`` while the config enables it.

    ``handler`` is a function ``(engine, body) -> Mapping`` (``body``: the request's JSON
    object, ``engine``: the serving :class:`~nxdplug.engine.Engine`). It runs on the thread
    that steps the engine, between two steps, so it may change what the model holds (write an
    adapter into its weights) without racing a step: through ``engine.apply_to_model``, so that
    every tensor-parallel rank makes the change to its shard. Its result is answered as JSON,
    and an ``NxdPlugError`` it raises as a 400 with its message.
    """

    path: str = attrs.field(validator=_check_path)
    handler: str = ref_field()
