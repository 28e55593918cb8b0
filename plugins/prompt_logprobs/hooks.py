"""Prompt log-probabilities as a feature: ``NeuronConfig(enable_prompt_logprobs=True)`` adds a
context-encoding phase that ``forward(prompt_logprobs=True)`` runs instead of the core's one.

It is a setting rather than always on because the phase is one more graph per context bucket to
compile. Not an NxD Inference attribute: NxD Inference returns the last token's logits only.
"""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import CliExtension, Feature, PhaseOutput, hookimpl

NXDPLUG_API_VERSION = 2

SETTING = "enable_prompt_logprobs"
MODULE = "nxdplug.plugins.prompt_logprobs.scoring"
# The request setting, the forward() keyword that selects the scoring phase, and the
# RequestOutput attribute: vLLM's name.
PROMPT_LOGPROBS = "prompt_logprobs"
# The tensors the scoring phase adds to forward()'s outputs.
OUTPUTS = ("prompt_logprobs", "prompt_ranks", "prompt_top_logprobs", "prompt_top_ids")
# What to do when asked for prompt log-probabilities by a model without the scoring phase.
NO_SCORING_PHASE = (
    "prompt log-probabilities need a model that scores prompts: load it with "
    "NeuronConfig(enable_prompt_logprobs=True) (nxdplug serve --enable-prompt-logprobs)"
)


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
def nxdplug_phase_outputs() -> Iterable[PhaseOutput]:
    yield PhaseOutput(
        name=PROMPT_LOGPROBS,
        implementation="nxdplug.plugins.prompt_logprobs.scores:PromptScores",
        outputs=OUTPUTS,
        missing=NO_SCORING_PHASE,
        description="vLLM's prompt_logprobs: each prompt token's log-probability, rank and "
        "likeliest alternatives, on a request's first output",
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
