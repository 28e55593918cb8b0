"""A request's prompt scores (vLLM's ``prompt_logprobs`` setting and output), from its row of
the scoring phase's outputs; the PhaseOutput record's implementation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from nxdplug.plugin_api import MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    from nxdplug.plugin_api import CausalLMOutputWithTokens


@attrs.frozen
class PromptLogprob:
    """One prompt token's score: its log-probability after the tokens before it, its rank
    among the vocabulary (1: the likeliest) and the likeliest ``(token, logprob)`` pairs at its
    position."""

    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


class PromptScores:
    """``SamplingSettings(prompt_logprobs=k)``: each prompt token's score with ``k``
    alternatives; ``RequestOutput.prompt_logprobs``: those scores, None for the first token
    (nothing predicts it)."""

    def problem(self, value: Any) -> str | None:
        whole = isinstance(value, int) and not isinstance(value, bool)
        if whole and 0 <= value <= MAX_TOP_LOGPROBS:
            return None
        return f"must be in [0, {MAX_TOP_LOGPROBS}] or null, got {value!r}"

    def row_value(
        self,
        outputs: CausalLMOutputWithTokens,
        row: int,
        prompt_ids: Sequence[int],
        value: Any,
    ) -> tuple[PromptLogprob | None, ...]:
        length, alternatives = len(prompt_ids), value
        logprobs = outputs["prompt_logprobs"][row, :length].tolist()
        ranks = outputs["prompt_ranks"][row, :length].tolist()
        top_logprobs = outputs["prompt_top_logprobs"][row, :length, :alternatives].tolist()
        top_ids = outputs["prompt_top_ids"][row, :length, :alternatives].tolist()
        scores: list[PromptLogprob | None] = [None]
        for j in range(1, length):
            top = tuple(zip(top_ids[j], top_logprobs[j], strict=True))
            scores.append(PromptLogprob(prompt_ids[j], logprobs[j], ranks[j], top))
        return tuple(scores)
