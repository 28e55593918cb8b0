"""Tool-call parsers as a plugin: ``nxdplug serve --enable-auto-tool-choice --tool-call-parser
NAME`` takes one of them by the name vLLM gives the same format."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import hookimpl
from nxdplug.plugins.serve.records import ToolParser

NXDPLUG_API_VERSION = 2


@hookimpl(optionalhook=True)  # a hook of the serve plugin
def nxdplug_tool_parsers() -> Iterable[ToolParser]:
    yield ToolParser(
        name="hermes",
        implementation="nxdplug.plugins.tool_calling.hermes:HermesParser",
        description="<tool_call>{json}</tool_call> (Hermes 2 Pro, Qwen2, Qwen2.5)",
    )
    yield ToolParser(
        name="llama3_json",
        implementation="nxdplug.plugins.tool_calling.llama3_json:Llama3JsonParser",
        description='{"name": ..., "parameters": ...} replies (Llama 3.1-3.3)',
    )
    yield ToolParser(
        name="mistral",
        implementation="nxdplug.plugins.tool_calling.mistral:MistralParser",
        description="[TOOL_CALLS] then a JSON array, or name[ARGS]{json} (Mistral, Mixtral)",
    )
