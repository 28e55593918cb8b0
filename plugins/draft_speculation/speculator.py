"""Chain speculation: k proposed tokens per row, verified by the target in one call.

Each step, per row: the last committed token and k drafts go into the target's speculation
sub-model at consecutive cache positions; its k+1 logits decide how many drafts to keep
(greedy matching, or the rejection rule when sampling) and give one token of the target's own.
Rows keep their own counts, so their positions drift apart; the target's cache needs no repair,
since a rejected draft's entries sit beyond the row's position and are overwritten before any
later query can see them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nxdplug.plugin_api import (
    AcceptanceStats,
    GeneratedRows,
    NotSupportedError,
    NxdPlugError,
    SpeculativeRequest,
    accept,
)
from nxdplug.plugins.draft_speculation.proposers import (
    DraftModelProposer,
    PromptLookupProposer,
    Proposer,
)

if TYPE_CHECKING:
    from nxdplug.plugin_api import NeuronBaseForCausalLM


class ChainSpeculator:
    """The implementation of the ``draft-model`` speculation mode."""

    def __init__(self, application: NeuronBaseForCausalLM) -> None:
        self.application = application
        self.k = application.neuron_config.speculation_length

    def proposer(self, request: SpeculativeRequest) -> Proposer:
        if request.assistant_model is not None:
            vocab = self.application.config.vocab_size
            return DraftModelProposer(request.assistant_model, self.k, request.choice, vocab)
        if request.prompt_lookup_num_tokens:
            return PromptLookupProposer(request.prompt_lookup_num_tokens, self.k)
        raise NotSupportedError(
            f"speculation_length={self.k} verifies proposed tokens, but nothing proposes them: "
            "pass generate(assistant_model=<draft application>) or prompt_lookup_num_tokens=n"
        )

    def _check_room(self, request: SpeculativeRequest) -> None:
        needed = request.input_ids.shape[1] + request.max_new_tokens + self.k
        seq_len = self.application.neuron_config.seq_len
        if needed > seq_len:
            raise NxdPlugError(
                f"speculation needs {needed} positions (prompt {request.input_ids.shape[1]} + "
                f"{request.max_new_tokens} new tokens + speculation_length {self.k}) but "
                f"seq_len is {seq_len}; raise seq_len or lower max_new_tokens"
            )

    def generate(self, request: SpeculativeRequest) -> torch.Tensor:
        self._check_room(request)
        proposer = self.proposer(request)
        target = self.application
        stats = target.speculation_stats = AcceptanceStats()
        batch = request.input_ids.shape[0]
        device = request.input_ids.device
        rows = GeneratedRows(
            batch, request.max_new_tokens, request.eos_token_ids, request.pad_token_id, device
        )
        target.reset()
        prompt = target(input_ids=request.input_ids, attention_mask=request.attention_mask)
        first = request.target_choice.choose(request.first_scores(prompt.logits[:, -1]))
        rows.commit(first[:, None], torch.ones(batch, dtype=torch.long, device=device))
        history = [
            [*ids[mask.bool()].tolist(), token]
            for ids, mask, token in zip(
                request.input_ids, request.attention_mask, first.tolist(), strict=True
            )
        ]
        positions = request.attention_mask.sum(dim=-1)  # where each row's last token goes
        proposer.start(request)
        steps = torch.arange(self.k + 1, device=device)
        while not rows.done:
            active = rows.active
            drafts, draft_logits = proposer.propose(history, positions)
            tokens = torch.cat([rows.last_tokens()[:, None], drafts], dim=1)
            verified = target(input_ids=tokens, position_ids=positions[:, None] + steps)
            scores = request.chain_scores(verified.logits, active, rows, drafts)
            chosen, counts = accept(request, drafts, draft_logits, scores)
            taken = rows.commit(chosen, counts)
            stats.record(self.k, counts[active] - 1, counts[active])
            for row in range(batch):
                history[row] += chosen[row, : taken[row]].tolist()
            positions = positions + taken
            proposer.committed(positions, (taken - 1).clamp(min=0))
        return rows.sequences(request.input_ids)
