"""EAGLE on the command line: ``--draft-model-path`` names the EAGLE draft, which goes into
the target's ``fused_spec_config`` as the NxD Inference feature guide builds it (a copy of the
target's NeuronConfig, token generation traced, not fused itself, ``is_eagle_draft``)."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from nxdplug.plugin_api import InferenceConfig, NeuronBaseForCausalLM


def attach_fused_draft(config: InferenceConfig, draft_path: Path) -> None:
    """Set ``config.fused_spec_config`` for the draft at ``draft_path``."""
    from nxdplug.plugin_api import FusedSpecNeuronConfig, architecture_for, load_pretrained_config

    worker_cls = architecture_for(draft_path).load("application")._model_cls
    neuron_config = config.neuron_config
    draft_neuron_config = copy.deepcopy(neuron_config)
    draft_neuron_config.trace_tokengen_model = True
    draft_neuron_config.enable_fused_speculation = False
    draft_neuron_config.enable_eagle_speculation = False
    draft_neuron_config.is_eagle_draft = bool(neuron_config.enable_eagle_speculation)
    draft_config = type(config)(draft_neuron_config, load_config=load_pretrained_config(draft_path))
    config.fused_spec_config = FusedSpecNeuronConfig(
        worker_cls=worker_cls, draft_config=draft_config, draft_model_path=str(draft_path)
    )


class EagleCommandLine:
    def add_arguments(self, parser: argparse.ArgumentParser, command: str) -> None:
        """``--draft-model-path`` is inference_demo's own option (core command line)."""

    def neuron_config_kwargs(self, args: argparse.Namespace) -> dict[str, Any]:
        return {}  # --speculation-length is a core NeuronConfig option

    def prepare_config(self, args: argparse.Namespace, config: InferenceConfig) -> None:
        """The draft of --draft-model-path, or of serve's --speculative-config (``eagle`` or
        ``eagle3``)."""
        path = getattr(args, "draft_model_path", None)
        speculative = getattr(args, "speculative_config", None)
        if path is None and speculative is not None and speculative.method in ("eagle", "eagle3"):
            path = Path(speculative.model)
        if path is not None:
            attach_fused_draft(config, path)

    def generate_keywords(
        self, args: argparse.Namespace, model: NeuronBaseForCausalLM
    ) -> dict[str, Any]:
        return {}  # the draft runs inside the target's graphs

    def hf_comparison(
        self,
        args: argparse.Namespace,
        model: NeuronBaseForCausalLM,
        load_hf_model: Callable[[Path], PreTrainedModel],
    ) -> None:
        return None  # HF transformers has no EAGLE decoding
