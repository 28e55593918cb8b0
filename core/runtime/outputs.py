"""What ``NeuronBaseForCausalLM.forward`` returns, and the contract of a scoring phase."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

# The forward() keyword that asks for the prompt's log-probabilities (vLLM's prompt_logprobs):
# it routes the prompt to the context-encoding phase a plugin selects by it
# (``ModelWrapper.selected_by``), which fills the ``prompt_*`` outputs below.
PROMPT_LOGPROBS = "prompt_logprobs"
# What to do when asked for prompt log-probabilities by a model without a scoring phase.
NO_SCORING_PHASE = (
    "prompt log-probabilities need a model that scores prompts: load it with "
    "NeuronConfig(enable_prompt_logprobs=True) (nxdplug serve --enable-prompt-logprobs)"
)
# The alternatives a scoring phase lists at each prompt position (OpenAI's top_logprobs bound).
PROMPT_TOP_LOGPROBS = 20


@dataclass
class CausalLMOutputWithTokens(CausalLMOutputWithPast):
    """What NeuronBaseForCausalLM.forward returns.

    ``logits`` [batch, 1, vocab]: each row's last-token logits; None with on-device sampling
    unless ``output_logits`` is set. ``tokens`` [batch, 1]: the token the model sampled for
    each row, with on-device sampling; None otherwise.

    With ``forward(prompt_logprobs=True)``, for each row's prompt from its first real token
    (right-padded to the width encoded: the context bucket, or for an eager model the prompt
    rounded up to 32 tokens): ``prompt_logprobs`` [batch, bucket] the float32
    log-probability of each prompt token given the ones before it (NaN at the first token,
    which nothing predicts), ``prompt_ranks`` [batch, bucket] its rank among the vocabulary
    (1: the likeliest), and ``prompt_top_logprobs`` / ``prompt_top_ids`` [batch, bucket,
    PROMPT_TOP_LOGPROBS] the likeliest tokens at each position, predicting the next one.
    """

    tokens: torch.LongTensor | None = None
    prompt_logprobs: torch.FloatTensor | None = None
    prompt_ranks: torch.LongTensor | None = None
    prompt_top_logprobs: torch.FloatTensor | None = None
    prompt_top_ids: torch.LongTensor | None = None


def join_outputs(parts: list[CausalLMOutputWithTokens]) -> CausalLMOutputWithTokens:
    """The outputs of consecutive row groups of one step, as one output."""
    fields = ("logits", "tokens")
    joined = {
        name: None
        if getattr(parts[0], name) is None
        else torch.cat([getattr(p, name) for p in parts])
        for name in fields
    }
    return CausalLMOutputWithTokens(**joined)
