"""EagleSpeculator: a whole ``generate()`` with fused EAGLE speculation.

Per row, with L committed tokens x_0..x_{L-1} (prompt compacted to positions 0..P-1):

- the target's cache holds x_0..x_{L-2} (the newest token has not been fed yet);
- the draft's cache holds the pairs (x_{t+1}, f_t) with real features for t < L-2 - a, and
  the *pending* pairs t = L-2-a..L-2 (a = drafts accepted by the last call, so 1..k+1 of
  them) are handed to the next call with the features that call's target computed.

Context call (``eagle_context_encoding_model``): target over the prompt (f_0..f_{P-1}, logits
of x_P), draft over the pairs t = 0..P-2. The host picks x_P; the pending pair is
(x_P, f_{P-1}) at t = P-1.

Each speculation call (``fused_speculation_model``) re-encodes the pending pairs, drafts
d_1..d_k, and the target scores [x_{L-1}, d_1..d_k] at positions L-1..L-1+k. The host keeps
the leading drafts the rule accepts plus one target token (greedy: the target's argmax;
sampling: speculative sampling with q the draft's ``softmax(logits / T)``, so the output is
distributed as the target's), and the next pending pairs are those tokens with the target's
features of the positions before them: (tokens[i], features[i]) at t = L-1+i, i <= a.
Finished rows (including those that finish in a call) keep their inputs; their outputs are
ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nxdplug.plugin_api import (
    FUSED_SPECULATION_MODEL_TAG,
    AcceptanceStats,
    GeneratedRows,
    NxdPlugError,
    SpeculativeRequest,
    StepInputs,
    TokenChoice,
    compact_left,
    greedy_acceptance,
    positions_from_mask,
    rejection_acceptance,
)
from nxdplug.plugins.eagle.fused import EAGLE_CONTEXT_TAG

if TYPE_CHECKING:
    from nxdplug.plugin_api import NeuronBaseForCausalLM


def gumbel_noise(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """-log(-log(U)): ``argmax(log q + noise)`` is an exact draw from q."""
    uniform = torch.rand(shape, device=device).clamp(min=torch.finfo(torch.float32).tiny)
    return -torch.log(-torch.log(uniform))


class EagleSpeculator:
    """The ``implementation`` of the ``eagle`` speculation mode."""

    def __init__(self, application: NeuronBaseForCausalLM) -> None:
        self.application = application
        self.context = application.submodel(EAGLE_CONTEXT_TAG)
        self.speculation = application.submodel(FUSED_SPECULATION_MODEL_TAG)
        self.k = application.neuron_config.speculation_length

    def generate(self, request: SpeculativeRequest) -> torch.Tensor:
        app, k = self.application, self.k
        rows, seq_ids, pending = self._begin(request, k + 1)
        if pending is None:
            return rows.sequences(request.input_ids)
        stats = app.speculation_stats
        pending_tokens, pending_features, pending_positions, pending_count = pending
        batch, device = pending_tokens.shape[0], pending_tokens.device
        offsets = torch.arange(k + 1, device=device)
        inv_temperature = self._inv_temperature(request.choice, batch, device)
        while not rows.done:
            noise_shape = (batch, k, app.config.vocab_size)
            noise = (
                gumbel_noise(noise_shape, device)
                if request.choice.do_sample
                else torch.zeros(noise_shape, device=device)
            )
            step = StepInputs(
                pending_tokens,
                torch.ones_like(pending_tokens),  # the wrapper widens it to the bucket
                pending_positions,
                seq_ids,
                {
                    "pending_features": pending_features,
                    "pending_count": pending_count,
                    "draft_noise": noise,
                    "inv_temperature": inv_temperature,
                },
            )
            drafts, draft_logits, target_logits, features = self.speculation(step)
            active = rows.active
            scores = request.chain_scores(target_logits, active, rows, drafts)
            new_tokens, counts = self._accept(
                request, drafts, draft_logits, scores, inv_temperature
            )
            rows.commit(new_tokens, counts)
            stats.record(k, (counts - 1)[active], counts[active])

            # A row that finished in this call keeps its inputs too: its new positions could
            # run past the cache (it may have produced more than its budget).
            going_on = rows.active
            base = pending_positions.gather(1, (pending_count - 1)[:, None])
            keep = going_on[:, None]
            pending_tokens = torch.where(keep, new_tokens, pending_tokens)
            pending_features = torch.where(keep[..., None], features, pending_features)
            pending_positions = torch.where(keep, base + 1 + offsets, pending_positions)
            pending_count = torch.where(going_on, counts, pending_count)
        return rows.sequences(request.input_ids)

    def _begin(
        self, request: SpeculativeRequest, width: int
    ) -> tuple[GeneratedRows, torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Encode the prompts (compacted to the left) and choose each row's first token.
        Returns the rows, their cache lines, and the first pending pairs, ``width`` slots a
        row: tokens, features, draft positions and counts (one pair: the first token with the
        prompt's last feature); None for the pairs when no token is asked for."""
        app = self.application
        self._refuse_proposers(request)
        app.reset()
        app.speculation_stats = AcceptanceStats()
        tokens, mask, positions = compact_left(
            request.input_ids, request.attention_mask, positions_from_mask(request.attention_mask)
        )
        lengths = mask.sum(dim=-1)
        self._check_length(int(lengths.max()), request.max_new_tokens)
        batch, device = tokens.shape[0], tokens.device
        seq_ids = torch.arange(batch, device=device)
        rows = GeneratedRows(
            batch, request.max_new_tokens, request.eos_token_ids, request.pad_token_id, device
        )
        if request.max_new_tokens <= 0:
            return rows, seq_ids, None
        logits, feature = self.context(StepInputs(tokens, mask, positions, seq_ids))
        first = request.target_choice.choose(request.first_scores(logits[:, -1]))
        rows.commit(first[:, None], torch.ones(batch, dtype=torch.long, device=device))
        pending_tokens = torch.full(
            (batch, width), request.pad_token_id, dtype=torch.long, device=device
        )
        pending_tokens[:, 0] = first
        pending_features = feature.new_zeros(batch, width, feature.shape[-1])
        pending_features[:, :1] = feature
        pending_positions = (lengths - 1)[:, None] + torch.arange(width, device=device)
        pending_count = torch.ones(batch, dtype=torch.long, device=device)
        return rows, seq_ids, (pending_tokens, pending_features, pending_positions, pending_count)

    @staticmethod
    def _refuse_proposers(request: SpeculativeRequest) -> None:
        if request.assistant_model is not None or request.prompt_lookup_num_tokens:
            raise NxdPlugError(
                "EAGLE drafts with its fused draft model; do not pass assistant_model or "
                "prompt_lookup_num_tokens"
            )

    def _check_length(self, prompt: int, new_tokens: int) -> None:
        seq_len = self.application.neuron_config.seq_len
        needed = prompt + new_tokens + self.k - 1
        if needed > seq_len:
            raise NxdPlugError(
                f"EAGLE with speculation_length={self.k} writes up to {needed} cache positions "
                f"for a {prompt}-token prompt and {new_tokens} new tokens, but seq_len is "
                f"{seq_len}; raise seq_len or ask for fewer new tokens"
            )

    @staticmethod
    def _inv_temperature(choice: TokenChoice, batch: int, device: torch.device) -> torch.Tensor:
        temperature = choice.params.temperature if choice.do_sample else 1.0
        return torch.full((batch, 1), 1.0 / temperature, device=device)

    @staticmethod
    def _accept(
        request: SpeculativeRequest,
        drafts: torch.Tensor,
        draft_logits: torch.Tensor,
        target_scores: torch.Tensor,
        inv_temperature: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy matching, or speculative sampling with q the distribution the graph drew
        the drafts from (``softmax(logits / T)``), p the target's processed distribution."""
        if not request.choice.do_sample:
            return greedy_acceptance(drafts, target_scores)
        q = (draft_logits * inv_temperature[:, :, None]).softmax(dim=-1)
        p = request.target_choice.probabilities(target_scores)
        return rejection_acceptance(drafts, q, p)


def eagle_speculator(application: NeuronBaseForCausalLM) -> EagleSpeculator:
    """The mode's implementation: the chain's speculator, or the tree's when the model was
    built with ``token_tree_config``."""
    if application.neuron_config.token_tree_config is None:
        return EagleSpeculator(application)
    from nxdplug.plugins.eagle.tree_speculator import EagleTreeSpeculator

    return EagleTreeSpeculator(application)
