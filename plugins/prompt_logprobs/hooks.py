"""Prompt log-probabilities as a feature: ``NeuronConfig(enable_prompt_logprobs=True)`` adds a
context-encoding phase that ``forward(prompt_logprobs=True)`` runs instead of the core's one.

It is a setting rather than always on because the phase is one more graph per context bucket to
compile. Not an NxD Inference attribute: NxD Inference returns the last token's logits only.
"""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import CliExtension, Feature, hookimpl

NXDPLUG_API_VERSION = 2

SETTING = "enable_prompt_logprobs"
MODULE = "nxdplug.plugins.prompt_logprobs.scoring"


@hookimpl
def nxdplug_features() -> Iterable[Feature]:
    yield Feature(
        name="prompt-logprobs",
        enabled_by=(SETTING,),
        settings={SETTING: False},
        validate=f"{MODULE}:validate",
        add_submodels=f"{MODULE}:add_submodels",
        description="a context encoding that also returns each prompt token's log-probability "
        "and the likeliest alternatives (forward(prompt_logprobs=True))",
    )


@hookimpl
def nxdplug_cli_extensions() -> Iterable[CliExtension]:
    yield CliExtension(
        name="prompt-logprobs",
        implementation="nxdplug.plugins.prompt_logprobs.cli:PromptLogprobsCommandLine",
        enabled_by=(SETTING,),
        commands=("serve", "compile", "check-config"),
        description="--enable-prompt-logprobs",
    )
