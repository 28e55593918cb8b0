"""The pipeline callbacks of the ``medusa`` speculation mode: run only while it is enabled."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from nxdplug.plugin_api import ModelWrapper
from nxdplug.plugins.medusa.heads import HEADS_ATTRIBUTE, medusa_heads, num_layers
from nxdplug.plugins.medusa.hooks import DEFAULT_LAYERS, HEADS_PATH_SETTING, LAYERS_SETTING
from nxdplug.plugins.medusa.submodels import MedusaContextWrapper, MedusaTreeWrapper
from nxdplug.plugins.medusa.tree import MedusaTree, tree_problems

if TYPE_CHECKING:
    from nxdplug.plugin_api import PipelineContext


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate(context: PipelineContext) -> list[str]:
    """The Medusa settings, all problems at once."""
    config, neuron_config = context.config, context.neuron_config
    problems = [
        f"is_medusa=True needs {name} of 1 or more (it is {getattr(neuron_config, name)})"
        for name in ("num_medusa_heads", "medusa_speculation_length")
        if _is_count(getattr(neuron_config, name)) and getattr(neuron_config, name) < 1
    ]
    problems += tree_problems(
        neuron_config.medusa_tree,
        neuron_config.num_medusa_heads,
        neuron_config.medusa_speculation_length,
        getattr(config, "vocab_size", None),
    )
    layers = getattr(neuron_config, LAYERS_SETTING, DEFAULT_LAYERS)
    if not _is_count(layers) or layers < 0:
        problems.append(f"{LAYERS_SETTING} is {layers!r}; give the ResBlocks per head (>= 0)")
    heads_path = getattr(neuron_config, HEADS_PATH_SETTING, None)
    if heads_path is not None and not (isinstance(heads_path, str) and Path(heads_path).is_dir()):
        problems.append(
            f"{HEADS_PATH_SETTING} is {heads_path!r}; give the folder of the Medusa heads file "
            "as a string, or leave it out to read the one beside the checkpoint"
        )
    return problems


def add_heads(model: nn.Module, context: PipelineContext) -> None:
    """Give the model its heads (``model.medusa_head``), filled from the state dict."""
    config = context.config
    heads = medusa_heads(
        config.neuron_config.num_medusa_heads,
        num_layers(config),
        config.hidden_size,
        config.vocab_size,
    )
    setattr(model, HEADS_ATTRIBUTE, heads)


def add_submodels(context: PipelineContext) -> Iterable[ModelWrapper]:
    """A context encoding that also runs the heads, and the tree verifier."""
    tree = MedusaTree(context.neuron_config.medusa_tree)
    return [
        MedusaContextWrapper(context.config, context.model_cls, tree),
        MedusaTreeWrapper(context.config, context.model_cls, tree),
    ]
