"""Structured outputs as a plugin: llguidance (the library vLLM's ``guidance`` backend uses)
compiles a request's constraint and computes, at each step, the tokens that keep it possible."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import StructuredOutputBackend, hookimpl

NXDPLUG_API_VERSION = 2


@hookimpl
def nxdplug_structured_output_backends() -> Iterable[StructuredOutputBackend]:
    yield StructuredOutputBackend(
        name="llguidance",
        implementation="nxdplug.plugins.structured_outputs.guidance:GuidanceCompiler",
        kinds=("json", "regex", "choice", "grammar"),
        description="JSON schema, regex, choice and Lark grammar constraints (pip install "
        "llguidance)",
    )
