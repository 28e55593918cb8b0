"""The hooks ``nxdplug serve`` adds for other plugins: routes, tool-call and reasoning parsers.

A plugin implementing them marks its implementations ``@hookimpl(optionalhook=True)``, so that it
still loads where the serve plugin is not installed (or denied).
"""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import RecordKind, hookspec
from nxdplug.plugins.serve.records import ReasoningParser, ServingRoute, ToolParser


class ServingSpecs:
    """What plugins add to ``nxdplug serve``."""

    @hookspec
    def nxdplug_serving_routes(self) -> Iterable[ServingRoute]:
        """Register HTTP routes of a feature, run between the engine's steps.

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_serving_routes():
                yield ServingRoute(
                    name="load-my-adapter",
                    path="/v1/load_my_adapter",
                    handler="my_pkg.routes:load_my_adapter",
                    enabled_by=("my_adapters",),
                )
        """

    @hookspec
    def nxdplug_reasoning_parsers(self) -> Iterable[ReasoningParser]:
        """Register a reader of the reasoning a model family writes before its answer, for
        chat replies' ``reasoning_content`` (``nxdplug serve --reasoning-parser NAME``).

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_reasoning_parsers():
                yield ReasoningParser(
                    name="my-thoughts",
                    implementation="my_pkg.reasoning:MyThoughtsSplitter",
                )
        """

    @hookspec
    def nxdplug_tool_parsers(self) -> Iterable[ToolParser]:
        """Register a parser of the tool calls a model family writes, for chat completions'
        ``tool_choice: "auto"`` (``nxdplug serve --tool-call-parser NAME``).

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_tool_parsers():
                yield ToolParser(
                    name="my-format",
                    implementation="my_pkg.tool_calls:MyFormatParser",
                )
        """


RECORD_KINDS = (
    RecordKind("serving_routes", "nxdplug_serving_routes", ServingRoute, "serving route"),
    RecordKind("tool_parsers", "nxdplug_tool_parsers", ToolParser, "tool-call parser"),
    RecordKind(
        "reasoning_parsers", "nxdplug_reasoning_parsers", ReasoningParser, "reasoning parser"
    ),
)
