"""Draft-model speculation on the command line: ``--draft-model-path`` is the second
application ``generate(assistant_model=...)`` drafts with; ``benchmark --compare-hf`` runs HF
transformers' assisted generation with the same draft and k, or its prompt lookup."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nxdplug.plugin_api import application_without_speculation

if TYPE_CHECKING:
    from pathlib import Path

    from transformers import PreTrainedModel

    from nxdplug.plugin_api import InferenceConfig, NeuronBaseForCausalLM


class DraftModelCommandLine:
    def add_arguments(self, parser: argparse.ArgumentParser, command: str) -> None:
        """``--draft-model-path`` and ``--prompt-lookup-num-tokens`` are inference_demo's own
        options, which the core command line already has."""

    def neuron_config_kwargs(self, args: argparse.Namespace) -> dict[str, Any]:
        return {}  # --speculation-length is a core NeuronConfig option

    def prepare_config(self, args: argparse.Namespace, config: InferenceConfig) -> None:
        """The draft is a separate application: the target's config is complete as it is."""

    def generate_keywords(
        self, args: argparse.Namespace, model: NeuronBaseForCausalLM
    ) -> dict[str, Any]:
        if args.draft_model_path is None:
            return {}
        draft = application_without_speculation(args, args.draft_model_path, model.config, "-draft")
        return {"assistant_model": draft}

    def hf_comparison(
        self,
        args: argparse.Namespace,
        model: NeuronBaseForCausalLM,
        load_hf_model: Callable[[Path], PreTrainedModel],
    ) -> tuple[PreTrainedModel, dict[str, Any]]:
        """Assisted generation with k tokens per round (constant schedule, no confidence
        cut), or prompt lookup."""
        hf_model = load_hf_model(args.model_path)
        lookup = getattr(args, "prompt_lookup_num_tokens", None)
        if lookup:
            return hf_model, {"prompt_lookup_num_tokens": lookup}
        draft = load_hf_model(args.draft_model_path)
        draft.generation_config.num_assistant_tokens = model.neuron_config.speculation_length
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        return hf_model, {"assistant_model": draft}
