"""Reasoning parsers as a plugin: ``nxdplug serve --reasoning-parser NAME`` takes one of them
by the name vLLM gives the same format."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import hookimpl
from nxdplug.plugins.serve.records import ReasoningParser

NXDPLUG_API_VERSION = 2


@hookimpl(optionalhook=True)  # a hook of the serve plugin
def nxdplug_reasoning_parsers() -> Iterable[ReasoningParser]:
    yield ReasoningParser(
        name="qwen3",
        implementation="nxdplug.plugins.reasoning.think_tags:ThinkTags",
        description="<think>...</think> before the answer, when the reply or its prompt opens "
        "it (Qwen3, QwQ)",
    )
    yield ReasoningParser(
        name="deepseek_r1",
        implementation="nxdplug.plugins.reasoning.think_tags:ThinksFirst",
        description="reasoning until </think>, <think> or not (DeepSeek-R1, whose template "
        "opens it in the prompt)",
    )
