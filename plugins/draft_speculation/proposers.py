"""Where speculated tokens come from: a draft model, or n-gram lookup in the sequence so far.

A proposer offers k tokens per row after each row's last committed token, and learns after
each verification how many tokens each row committed. Positions are cache positions: the last
committed token of a row sits at ``positions[row]``, and the target has not seen it yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from nxdplug.plugin_api import NotSupportedError, SpeculativeRequest, TokenChoice

if TYPE_CHECKING:
    from nxdplug.plugin_api import NeuronBaseForCausalLM


class Proposer(Protocol):
    def start(self, request: SpeculativeRequest) -> None:
        """Take the prompt (the draft encodes it)."""

    def propose(
        self, history: list[list[int]], positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(drafts [batch, k], draft logits [batch, k, vocab] or None)`` following each row's
        ``history`` (its real tokens so far, the last one at ``positions[row]``)."""

    def committed(self, positions: torch.Tensor, accepted: torch.Tensor) -> None:
        """Each row kept ``accepted`` of the drafts; its last token is now at ``positions``."""


def is_application(model: object) -> bool:
    return hasattr(model, "neuron_config") and hasattr(model, "kv_cache_populated")


class DraftModelProposer:
    """A smaller causal LM drafts k tokens, one call each, from its own KV cache.

    The draft sees a token when it drafts the next one, so after a verification its cache
    holds every committed token except, when a row accepted all k drafts, the last draft (it
    was proposed but never fed back). Before drafting, one call re-encodes each row's
    second-to-last committed token: for such rows this fills the gap, for the others it
    rewrites what the cache already holds. The call is skipped when no row needs it.
    """

    def __init__(
        self, draft: NeuronBaseForCausalLM, k: int, choice: TokenChoice, vocab_size: int
    ) -> None:
        if not is_application(draft):
            raise NotSupportedError(
                f"assistant_model must be an nxdplug application (NeuronBaseForCausalLM built "
                f"with to_cpu() or load()), not {type(draft).__name__}"
            )
        if draft.neuron_config.on_device_sampling_config is not None:
            raise NotSupportedError(
                "the draft model samples on the device, but speculation needs its logits: "
                "build the draft without on_device_sampling_config"
            )
        if draft.config.vocab_size != vocab_size:
            raise NotSupportedError(
                f"the draft's vocabulary ({draft.config.vocab_size} tokens) differs from the "
                f"target's ({vocab_size}); a draft must share the target's tokenizer"
            )
        self.draft = draft
        self.k = k
        self.choice = choice
        self.valid: torch.Tensor | None = None  # [batch] cache positions the draft holds

    def start(self, request: SpeculativeRequest) -> None:
        self.draft.reset()
        self.draft(input_ids=request.input_ids, attention_mask=request.attention_mask)
        self.valid = request.attention_mask.sum(dim=-1)

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed one token per row at ``positions``; return the logits after it [batch, vocab]."""
        outputs = self.draft(input_ids=tokens[:, None], position_ids=positions[:, None])
        return outputs.logits[:, -1]

    def propose(
        self, history: list[list[int]], positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if bool((self.valid < positions).any()):
            before_last = torch.tensor([row[-2] for row in history], device=positions.device)
            self._step(before_last, positions - 1)
        token = torch.tensor([row[-1] for row in history], device=positions.device)
        drafts, logits = [], []
        for step in range(self.k):
            step_logits = self._step(token, positions + step)
            token = self.choice.choose(step_logits)
            drafts.append(token)
            logits.append(step_logits)
        return torch.stack(drafts, dim=1), torch.stack(logits, dim=1)

    def committed(self, positions: torch.Tensor, accepted: torch.Tensor) -> None:
        # The draft fed the previous last token and drafts 1..k-1: positions up to
        # old + k - 1 hold committed tokens when fewer than k were accepted.
        old = positions - accepted - 1
        self.valid = torch.minimum(positions, old + self.k)


class PromptLookupProposer:
    """Propose the tokens that followed the latest earlier occurrence of the sequence's last
    n-gram (n from ``max_ngram`` down to 1), as HF transformers' prompt lookup decoding does;
    without a match, repeat the last token. Up to ``num_tokens`` come from the lookup; the
    rest of the k drafts repeat the last one looked up (they are verified like any other)."""

    def __init__(self, num_tokens: int, k: int, max_ngram: int = 2) -> None:
        if num_tokens > k:
            raise NotSupportedError(
                f"prompt_lookup_num_tokens={num_tokens} is more than the model verifies per "
                f"call (speculation_length={k}); pass at most {k}, or compile with a larger "
                "speculation_length"
            )
        self.num_tokens = num_tokens
        self.k = k
        self.max_ngram = max_ngram

    def start(self, request: SpeculativeRequest) -> None:
        """Nothing to encode: the lookup reads the history."""

    def lookup(self, tokens: list[int]) -> list[int]:
        """The tokens following an earlier occurrence of the last n-gram, or []."""
        for size in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            pattern = tokens[-size:]
            for start in range(len(tokens) - size):
                if tokens[start : start + size] == pattern:
                    follow = tokens[start + size : start + size + self.num_tokens]
                    if follow:
                        return follow
        return []

    def propose(
        self, history: list[list[int]], positions: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        rows = []
        for tokens in history:
            found = self.lookup(tokens) or [tokens[-1]]
            rows.append(found + [found[-1]] * (self.k - len(found)))
        return torch.tensor(rows, device=positions.device), None

    def committed(self, positions: torch.Tensor, accepted: torch.Tensor) -> None:
        """Nothing to keep: the next lookup reads the longer history."""
