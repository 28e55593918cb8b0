"""Medusa speculative decoding (``is_medusa=True``), with NxD Inference's attributes.

``num_medusa_heads`` heads on the target's last hidden state propose the next tokens; the
``medusa_tree`` says which combinations of their top-k are verified, all in one target call,
and ``medusa_speculation_length`` is the tree's size (its paths plus the root). The heads come
from the heads file beside the checkpoint (see :mod:`nxdplug.plugins.medusa.heads`), and are
modules of the model, so every phase and the compiled graphs share them with the target.

The plugin adds two sub-models (a context encoding that also runs the heads, and the tree
verifier; see :mod:`nxdplug.plugins.medusa.submodels`) and a speculator
(:mod:`nxdplug.plugins.medusa.speculator`) that ``HuggingFaceGenerationAdapter.generate``
hands greedy generation to. The core token-generation model is neither needed nor used, so
``trace_tokengen_model`` may be either value.
"""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import CliExtension, Feature, SpeculationMode, StateDictConverter, hookimpl

NXDPLUG_API_VERSION = 2

ENABLED_BY = ("is_medusa",)
# ResBlocks per head: not an NxD Inference attribute (its heads have one, as Medusa-1 releases).
LAYERS_SETTING = "medusa_num_layers"
DEFAULT_LAYERS = 1
# The heads file's folder when it is not the checkpoint's (vLLM's medusa ``model``).
HEADS_PATH_SETTING = "medusa_heads_path"
PIPELINE = "nxdplug.plugins.medusa.pipeline"


@hookimpl
def nxdplug_speculation_modes() -> Iterable[SpeculationMode]:
    yield SpeculationMode(
        name="medusa",
        implementation="nxdplug.plugins.medusa.speculator:MedusaSpeculator",
        enabled_by=ENABLED_BY,
        validate=f"{PIPELINE}:validate",
        transform_model=f"{PIPELINE}:add_heads",
        add_submodels=f"{PIPELINE}:add_submodels",
        engine_methods=("medusa",),
        engine_fused="nxdplug.plugins.medusa.engine:MedusaEngineSpeculator",
        engine_settings="nxdplug.plugins.medusa.engine:engine_settings",
        description="Medusa heads propose a tree of tokens; the target verifies it in one call",
    )


@hookimpl
def nxdplug_features() -> Iterable[Feature]:
    yield Feature(
        name="medusa-heads",
        enabled_by=ENABLED_BY,
        settings={LAYERS_SETTING: DEFAULT_LAYERS, HEADS_PATH_SETTING: None},
        description=(
            "ResBlocks per Medusa head (medusa_num_layers, 1 in Medusa-1 releases), and the "
            "heads file's folder when not the checkpoint's (medusa_heads_path)"
        ),
    )


@hookimpl
def nxdplug_state_dict_converters() -> Iterable[StateDictConverter]:
    yield StateDictConverter(
        name="medusa-heads",
        converter="nxdplug.plugins.medusa.heads:add_medusa_heads",
        enabled_by=ENABLED_BY,
        order=90,
        description="add the Medusa heads file beside the checkpoint as medusa_head.{i}.*",
    )


@hookimpl
def nxdplug_cli_extensions() -> Iterable[CliExtension]:
    yield CliExtension(
        name="medusa-inference-demo",
        implementation="nxdplug.plugins.medusa.demo_flags:MedusaDemoFlags",
        commands=("inference_demo",),
        description="inference_demo's Medusa flag (--medusa-tree-json)",
    )
