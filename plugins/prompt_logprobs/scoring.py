"""The scoring phase: the prompt encoded into the cache as the core's context encoding does,
and its logits at every position turned into log-probabilities in the graph, so that only
``[rows, bucket, PROMPT_TOP_LOGPROBS]`` leaves it rather than ``bucket x vocab`` logits.

Position j of each output is about prompt token j: its log-probability after tokens 0..j-1,
its rank, and the likeliest tokens there. Nothing predicts token 0: NaN, rank 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from nxdplug.plugin_api import (
    PROMPT_LOGPROBS,
    PROMPT_TOP_LOGPROBS,
    CausalLMOutputWithTokens,
    ModelWrapper,
    StepInputs,
    last_token_states,
)

PROMPT_SCORING_TAG = "prompt_scoring_model"


class PromptScorer(nn.Module):
    """Tokens in; the last token's logits and the prompt's scores out (see the module)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, step: StepInputs) -> tuple[torch.Tensor, ...]:
        hidden = self.model.hidden_states(step)
        logits = self.model.lm_head(hidden).float()
        logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
        following = step.input_ids[:, 1:, None]
        chosen = logprobs.gather(-1, following)
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        top = logprobs.topk(min(PROMPT_TOP_LOGPROBS, logprobs.shape[-1]), dim=-1)
        first = torch.full_like(chosen[:, :1, 0], float("nan"))
        return (
            last_token_states(logits, step.attention_mask),
            torch.cat([first, chosen[..., 0]], dim=1),
            nn.functional.pad(ranks, (1, 0)),
            nn.functional.pad(top.values, (0, 0, 1, 0), value=float("nan")),
            nn.functional.pad(top.indices, (0, 0, 1, 0)),
        )


class PromptScoringWrapper(ModelWrapper):
    """Context-encoding buckets and batch size under its own tag, compiled beside the core's
    context encoding; ``forward(prompt_logprobs=True)`` routes a prompt here."""

    selected_by = PROMPT_LOGPROBS

    def __init__(self, config: Any, model_cls: type[nn.Module]) -> None:
        super().__init__(config, model_cls, tag=PROMPT_SCORING_TAG, is_context_encoding=True)

    def phase_module(self, model: nn.Module) -> nn.Module:
        return PromptScorer(model)

    def output_of(
        self, outputs: torch.Tensor | tuple[torch.Tensor, ...]
    ) -> CausalLMOutputWithTokens:
        logits, logprobs, ranks, top_logprobs, top_ids = outputs
        return CausalLMOutputWithTokens(
            logits=logits,
            prompt_logprobs=logprobs,
            prompt_ranks=ranks,
            prompt_top_logprobs=top_logprobs,
            prompt_top_ids=top_ids,
        )


def validate(context: Any) -> Iterable[str]:
    if context.neuron_config.on_device_sampling_config is not None:
        yield (
            "enable_prompt_logprobs: prompts are scored from the logits, which a model that "
            "samples in its graph does not return; set on_device_sampling_config=None"
        )


def add_submodels(context: Any) -> Iterable[ModelWrapper]:
    yield PromptScoringWrapper(context.config, context.model_cls)
