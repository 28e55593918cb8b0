"""The scoring phase: the prompt encoded into the cache as the core's context encoding does,
and its logits at every position turned into log-probabilities in the graph, so that only
``[rows, bucket, MAX_TOP_LOGPROBS]`` leaves it rather than ``bucket x vocab`` logits.

``forward(prompt_logprobs=True)`` returns, beside each row's last-token logits, for each row's
prompt from its first real token (right-padded to the width encoded: the context bucket, or for
an eager model the prompt rounded up to 32 tokens): ``prompt_logprobs`` [batch, bucket] the
float32 log-probability of each prompt token given the ones before it (NaN at the first token,
which nothing predicts), ``prompt_ranks`` [batch, bucket] its rank among the vocabulary (1: the
likeliest; 0 at the first token), and ``prompt_top_logprobs`` / ``prompt_top_ids`` [batch,
bucket, MAX_TOP_LOGPROBS] the likeliest tokens at each position, predicting the next one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from nxdplug.plugin_api import (
    MAX_TOP_LOGPROBS,
    CausalLMOutputWithTokens,
    ModelWrapper,
    StepInputs,
    last_token_states,
)
from nxdplug.plugins.prompt_logprobs.hooks import OUTPUTS, PROMPT_LOGPROBS

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, PipelineContext

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
        top = logprobs.topk(min(MAX_TOP_LOGPROBS, logprobs.shape[-1]), dim=-1)
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

    def __init__(self, config: InferenceConfig, model_cls: type[nn.Module]) -> None:
        super().__init__(config, model_cls, tag=PROMPT_SCORING_TAG, is_context_encoding=True)

    def phase_module(self, model: nn.Module) -> nn.Module:
        return PromptScorer(model)

    def output_of(
        self, outputs: torch.Tensor | tuple[torch.Tensor, ...]
    ) -> CausalLMOutputWithTokens:
        logits, *scores = outputs
        return CausalLMOutputWithTokens.with_outputs(
            logits, dict(zip(OUTPUTS, scores, strict=True))
        )


def validate(context: PipelineContext) -> Iterable[str]:
    if context.neuron_config.on_device_sampling_config is not None:
        yield (
            "enable_prompt_logprobs: prompts are scored from the logits, which a model that "
            "samples in its graph does not return; set on_device_sampling_config=None"
        )


def add_submodels(context: PipelineContext) -> Iterable[ModelWrapper]:
    yield PromptScoringWrapper(context.config, context.model_cls)
