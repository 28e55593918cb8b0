"""Fused EAGLE in the serving engine (vLLM's ``eagle`` and ``eagle3`` methods).

The engine encodes a request's prompt by the fused context phase (the target, and the draft
over the prompt's pairs), and each step runs the fused speculation phase for its requests:
the draft encodes each request's pending pairs, drafts k tokens greedily, and the target
scores them. The engine takes the tokens as from any verification (each position chosen as a
decode step chooses it, kept while it equals the draft), and the tokens a request took become
its next pending pairs, with the target's features of the positions before them (see
:mod:`nxdplug.plugins.eagle.speculator` for the pairs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from nxdplug.plugin_api import (
    FUSED_SPECULATION_MODEL_TAG,
    CausalLMOutputWithTokens,
    ConfigError,
    DraftTree,
    Request,
    ScheduledStep,
    SpeculativeConfig,
    StepInputs,
    chain_length,
)
from nxdplug.plugins.eagle.fused import EAGLE_CONTEXT_TAG

if TYPE_CHECKING:
    from nxdplug.plugin_api import NeuronBaseForCausalLM


def engine_settings(config: SpeculativeConfig) -> dict[str, Any]:
    """The model vLLM's ``eagle`` and ``eagle3`` methods need: the draft of ``model`` fused into
    the target (its graphs draft and verify; no one-token phase), an EAGLE-3 head for
    ``eagle3``. The command line's EAGLE extension attaches the draft."""
    if config.model is None:
        raise ConfigError(
            ["method 'eagle' needs 'model', the EAGLE draft's folder"],
            source="--speculative-config",
        )
    return {
        "enable_eagle_speculation": True,
        "enable_fused_speculation": True,
        "trace_tokengen_model": False,
        "is_eagle3": config.method == "eagle3",
    }


@attrs.define
class PendingPairs:
    """A request's pairs ``(x_{t+1}, f_t)`` the draft has not encoded with real features
    yet: the first at ``t = start``, ``count`` of them; ``tokens`` None right after the
    prompt (its one pair's token is the request's first, chosen after the prompt phase),
    ``features`` [k+1, hidden]. ``scored``: the target's features of the last
    verification, until the engine says how many tokens the request took."""

    tokens: list[int] | None
    features: torch.Tensor
    start: int
    count: int
    scored: torch.Tensor | None = None


class EagleEngineSpeculator:
    """The ``engine_fused`` of the ``eagle`` speculation mode."""

    def __init__(
        self,
        application: NeuronBaseForCausalLM,
        config: SpeculativeConfig,
        draft: NeuronBaseForCausalLM | None,
    ) -> None:
        problems = []
        if draft is not None:
            problems.append("EAGLE drafts with the draft fused into the model: give no draft")
        if application.neuron_config.on_device_sampling_config is not None:
            problems.append(
                "the engine chooses EAGLE's tokens on the host from the target's logits: build "
                "the model without on_device_sampling_config"
            )
        is_eagle3 = bool(application.neuron_config.is_eagle3)
        if (config.method == "eagle3") != is_eagle3:
            built = "an EAGLE-3 draft (is_eagle3=True)" if is_eagle3 else "an EAGLE-1 draft"
            wanted = "eagle3" if is_eagle3 else "eagle"
            problems.append(
                f"method {config.method!r}: the model was built with {built}; use method {wanted!r}"
            )
        if application.neuron_config.token_tree_config is not None:
            problems.append(
                "token_tree_config: the engine's EAGLE drafts a chain; token trees run in "
                "generate() (build the served model without token_tree_config)"
            )
        if application.neuron_config.tp_degree > 1:
            problems.append("EAGLE in the engine with tensor parallelism is not implemented")
        if problems:
            raise ConfigError(problems, source="the engine's speculative_config")
        self.context = application.submodel(EAGLE_CONTEXT_TAG)
        self.speculation = application.submodel(FUSED_SPECULATION_MODEL_TAG)
        self.k = application.neuron_config.speculation_length
        self.draft_depth = chain_length(config, self.k)
        self.vocab_size = application.config.vocab_size
        # The target scores up to k positions past the last token (see EagleSpeculator).
        self.positions_past_end = self.k - 1
        application.reset()

    def encode(self, requests: Sequence[Request], step: ScheduledStep) -> CausalLMOutputWithTokens:
        inputs = StepInputs(step.input_ids, step.cache_mask(), step.positions(), step.seq_ids)
        logits, feature = self.context(inputs)
        for row, request in enumerate(requests):
            features = feature.new_zeros(self.k + 1, feature.shape[-1])
            features[0] = feature[row, 0]
            start = int(step.num_new[row]) - 1  # (x_P, f_{P-1}): t = P-1
            request.proposer_state = PendingPairs(None, features, start, 1)
        return CausalLMOutputWithTokens(logits=logits, tokens=None)

    def verify(self, requests: Sequence[Request]) -> tuple[list[DraftTree], torch.Tensor]:
        rows, k = len(requests), self.k
        device = self.context.device
        pairs: list[PendingPairs] = [r.proposer_state for r in requests]
        tokens = torch.zeros(rows, k + 1, dtype=torch.long, device=device)
        for row, (request, pending) in enumerate(zip(requests, pairs, strict=True)):
            given = pending.tokens if pending.tokens is not None else request.output_ids[-1:]
            tokens[row, : len(given)] = torch.tensor(given)
        offsets = torch.arange(k + 1, device=device)
        starts = torch.tensor([p.start for p in pairs], device=device)
        step = StepInputs(
            tokens,
            torch.ones_like(tokens),  # the wrapper widens it to the bucket
            starts[:, None] + offsets,
            torch.tensor([r.line for r in requests], device=device),
            {
                "pending_features": torch.stack([p.features for p in pairs]),
                "pending_count": torch.tensor([p.count for p in pairs], device=device),
                "draft_noise": torch.zeros(rows, k, self.vocab_size, device=device),
                "inv_temperature": torch.ones(rows, 1, device=device),
            },
        )
        drafts, _, target_logits, features = self.speculation(step)
        for pending, scored in zip(pairs, features, strict=True):
            pending.scored = scored
        chains = [DraftTree.chain(row[: self.draft_depth]) for row in drafts.tolist()]
        return chains, target_logits

    def taken(self, requests: Sequence[Request], paths: Sequence[Sequence[int]]) -> None:
        for request, path in zip(requests, paths, strict=True):
            pending: PendingPairs = request.proposer_state
            assert pending.scored is not None
            start = pending.start + pending.count  # after the newest pending pair
            count = len(path)
            taken = request.output_ids[-count:]
            request.proposer_state = PendingPairs(taken, pending.scored, start, count)
