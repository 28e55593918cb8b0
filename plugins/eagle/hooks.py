"""EAGLE speculative decoding (EAGLE-1 and EAGLE-3 drafts, a chain or a token tree) with fused
speculation.

``enable_eagle_speculation=True`` (which turns ``enable_fused_speculation`` on) and
``speculation_length=k`` select the ``eagle`` speculation mode: the EAGLE draft named by
``config.fused_spec_config`` becomes the target model's ``eagle_draft`` submodule (its
checkpoint merged under ``eagle_draft.``, its own KV cache beside the target's), and two fused
sub-models draft and verify in one graph each (:mod:`nxdplug.plugins.eagle.fused`).
``HuggingFaceGenerationAdapter.generate`` then runs :class:`EagleSpeculator`, greedy or
sampled, whose output is the target's. The ``eagle-draft`` feature only declares
``is_eagle_draft``, which the feature guide sets on the draft's own config.
"""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import CliExtension, Feature, SpeculationMode, StateDictConverter, hookimpl

NXDPLUG_API_VERSION = 2

ENABLED_BY = ("enable_fused_speculation", "enable_eagle_speculation")
DRAFT = ("is_eagle_draft",)
PACKAGE = "nxdplug.plugins.eagle"


@hookimpl
def nxdplug_speculation_modes() -> Iterable[SpeculationMode]:
    yield SpeculationMode(
        name="eagle",
        implementation="nxdplug.plugins.eagle.speculator:eagle_speculator",
        enabled_by=ENABLED_BY,
        disabled_by=DRAFT,
        validate=f"{PACKAGE}.validation:validate",
        transform_model=f"{PACKAGE}.draft:add_draft",
        add_submodels=f"{PACKAGE}.fused:add_submodels",
        engine_methods=("eagle", "eagle3"),
        engine_fused=f"{PACKAGE}.engine:EagleEngineSpeculator",
        engine_settings=f"{PACKAGE}.engine:engine_settings",
        description=(
            "EAGLE-1 draft fused with the target: k drafts (a chain or a token tree) and "
            "their check in one graph"
        ),
    )


@hookimpl
def nxdplug_features() -> Iterable[Feature]:
    yield Feature(
        name="eagle-draft",
        enabled_by=DRAFT,
        description="marks the draft config inside fused_spec_config (is_eagle_draft)",
    )


@hookimpl
def nxdplug_state_dict_converters() -> Iterable[StateDictConverter]:
    yield StateDictConverter(
        name="eagle-draft-weights",
        converter="nxdplug.plugins.eagle.checkpoint:merge_draft_state_dict",
        enabled_by=("enable_eagle_speculation",),
        disabled_by=DRAFT,
        order=50,
        description="the EAGLE draft checkpoint, under eagle_draft.",
    )


@hookimpl
def nxdplug_cli_extensions() -> Iterable[CliExtension]:
    yield CliExtension(
        name="eagle",
        implementation=f"{PACKAGE}.cli:EagleCommandLine",
        enabled_by=ENABLED_BY,
        disabled_by=DRAFT,
        description="--draft-model-path is the EAGLE draft, fused into the target's config",
    )
    yield CliExtension(
        name="eagle-inference-demo",
        implementation="nxdplug.plugins.eagle.demo_flags:EagleDemoFlags",
        commands=("inference_demo",),
        description="inference_demo's EAGLE flag (--token-tree-json)",
    )
