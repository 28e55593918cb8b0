"""What a fused EAGLE config must hold, reported all at once before anything is built.

The target's NeuronConfig enables the mode (``enable_eagle_speculation`` with
``enable_fused_speculation``, ``speculation_length`` k >= 1); ``fused_spec_config`` names the
draft: its InferenceConfig (with ``is_eagle_draft=True``, as the feature guide sets it) and its
checkpoint folder. The draft must share the target's hidden size and vocabulary: it reads the
target's features and proposes the target's tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, PipelineContext

GUIDE = "see the feature guide's Fused Speculation example"


def validate(context: PipelineContext) -> list[str]:
    """The ``validate`` callback of the ``eagle`` speculation mode."""
    return list(eagle_config_problems(context.config))


def eagle_config_problems(config: InferenceConfig) -> Iterator[str]:
    """Problems of a target config that enables fused speculation."""
    neuron_config = config.neuron_config
    length = neuron_config.speculation_length
    if neuron_config.enable_eagle_speculation:
        if isinstance(length, int) and not isinstance(length, bool) and length < 1:
            yield (
                f"enable_eagle_speculation=True needs speculation_length 1 or more (it is {length})"
            )
        if not neuron_config.enable_fused_speculation:
            yield (
                "enable_eagle_speculation=True needs enable_fused_speculation=True: the EAGLE "
                "draft runs fused with the target (leave enable_fused_speculation at its "
                "default)"
            )
            return
    if not neuron_config.enable_eagle_speculation:
        yield (
            "enable_fused_speculation=True without enable_eagle_speculation fuses a plain LM "
            "draft, which is not supported; set enable_eagle_speculation=True with an EAGLE "
            "draft, or use draft-model speculation (enable_fused_speculation=False, "
            "speculation_length=k, generate(assistant_model=draft))"
        )
        return
    if neuron_config.trace_tokengen_model:
        yield (
            "trace_tokengen_model=True compiles a token-generation graph that fused EAGLE "
            "speculation never runs; set trace_tokengen_model=False on the target's "
            f"NeuronConfig ({GUIDE})"
        )
    fused = getattr(config, "fused_spec_config", None)
    if fused is None:
        yield (
            "enable_eagle_speculation=True needs config.fused_spec_config = "
            f"FusedSpecNeuronConfig(worker_cls, draft_config=..., draft_model_path=...) ({GUIDE})"
        )
        return
    if fused.draft_model_path is None:
        yield "fused_spec_config.draft_model_path is not set; give the EAGLE draft's folder"
    elif not Path(fused.draft_model_path).is_dir():
        yield f"fused_spec_config.draft_model_path {fused.draft_model_path} is not a folder"
    draft = fused.draft_config
    if draft is None:
        yield "fused_spec_config.draft_config is not set; give the EAGLE draft's InferenceConfig"
        return
    yield from draft_config_problems(config, draft)


def draft_config_problems(config: InferenceConfig, draft: InferenceConfig) -> Iterator[str]:
    """The draft config against the target's."""
    from nxdplug.plugin_api import core_config_problems

    draft_neuron_config = getattr(draft, "neuron_config", None)
    if draft_neuron_config is not None and not draft_neuron_config.is_eagle_draft:
        yield (
            "fused_spec_config.draft_config.neuron_config.is_eagle_draft is False; set it to "
            f"True for an EAGLE draft ({GUIDE})"
        )
    for name in ("hidden_size", "vocab_size"):
        mine, theirs = getattr(draft, name, None), getattr(config, name, None)
        if mine != theirs:
            yield (
                f"the EAGLE draft's {name} is {mine} but the target's is {theirs}; the draft "
                "must be trained for this target"
            )
    if getattr(draft, "num_hidden_layers", 0) < 1:
        yield "the EAGLE draft config has no decoder layers (num_hidden_layers < 1)"
    if config.neuron_config.is_eagle3:
        from nxdplug.plugins.eagle.draft3 import eagle3_draft_problems

        yield from eagle3_draft_problems(config, draft)
    yield from (f"fused_spec_config.draft_config: {p}" for p in core_config_problems(draft))
