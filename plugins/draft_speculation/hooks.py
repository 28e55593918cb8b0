"""Speculative decoding with a draft model (``speculation_length=k``), and prompt lookup.

The target gets a speculation sub-model that takes k+1 tokens per row and returns the logits
of each; ``HuggingFaceGenerationAdapter.generate(assistant_model=draft)`` drafts with a second
application, ``generate(prompt_lookup_num_tokens=n)`` looks the drafts up in the sequence.
Fused speculation (``enable_fused_speculation``, EAGLE) is another plugin's mode.
"""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import CliExtension, SpeculationMode, hookimpl

NXDPLUG_API_VERSION = 2


@hookimpl
def nxdplug_speculation_modes() -> Iterable[SpeculationMode]:
    yield SpeculationMode(
        name="draft-model",
        implementation="nxdplug.plugins.draft_speculation.speculator:ChainSpeculator",
        enabled_by=("speculation_length",),
        disabled_by=("enable_fused_speculation",),
        validate="nxdplug.plugins.draft_speculation.submodel:validate",
        add_submodels="nxdplug.plugins.draft_speculation.submodel:add_submodels",
        engine_methods=("ngram", "draft_model"),
        engine_proposer="nxdplug.plugins.draft_speculation.engine_proposers:engine_proposer",
        description="k tokens from a draft model or prompt lookup, verified in one target call",
    )


@hookimpl
def nxdplug_cli_extensions() -> Iterable[CliExtension]:
    yield CliExtension(
        name="draft-model",
        implementation="nxdplug.plugins.draft_speculation.cli:DraftModelCommandLine",
        enabled_by=("speculation_length",),
        disabled_by=("enable_fused_speculation",),
        description="--draft-model-path drafts with a second application",
    )
