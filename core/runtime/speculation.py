"""What every speculation mode shares: the request, acceptance rules, statistics, row outputs.

A speculation-mode plugin's implementation is a :class:`Speculator`: built with the target
application, it runs a whole generation for ``HuggingFaceGenerationAdapter.generate``. Each
step a proposer (a draft model, prompt lookup, Medusa heads, an EAGLE draft) offers k tokens per
row; the target scores them in one call; the rules below keep the leading tokens the target
agrees with and add one token of the target's own, so the output is the target's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import torch

from nxdplug.runtime.batch_sampler import greedy_tokens
from nxdplug.runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from nxdplug.runtime.application import NeuronBaseForCausalLM

# The settings under which a sampler leaves scores as they are (already processed and warped).
NEUTRAL_PARAMS = SamplingParams()


@attrs.frozen
class TokenChoice:
    """How tokens are chosen from logits: greedily, or sampled with ``params``.

    ``scores(logits)`` is the sampler plugin's processed scores (temperature, top-k, top-p).
    """

    sampler: Any
    params: SamplingParams
    do_sample: bool

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution tokens are drawn from, over the last dimension, in float32."""
        return self.sampler.scores(logits.float(), self.params).softmax(dim=-1)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row of [batch, vocab] logits."""
        return self.sampler(logits, self.params)

    def of_processed_scores(self) -> TokenChoice:
        """The same choice over scores the generation's warpers have already processed."""
        return attrs.evolve(self, params=NEUTRAL_PARAMS)


@attrs.frozen
class VerifiedProcessors:
    """transformers' processors at the positions a speculating target scores.

    As HF's assisted generation does, the processors (and the warpers, when sampling) run at
    every verified position with the sequence that position follows: the prompt as
    ``generate()`` got it (padding included, as without speculation), the row's committed
    tokens, then the proposals before that position. Rows commit different numbers of tokens,
    so one call takes the positions whose sequences have one length, at most one per row, in
    the whole batch: each row keeps its index (processors hold per-row state, such as a padded
    prompt's extent), and the other rows are filler whose scores are dropped.
    """

    processors: Any  # a transformers LogitsProcessorList
    prompt: torch.Tensor  # [batch, prompt]

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        """Scores of the token after the prompt, from [batch, vocab] logits."""
        return self.processors(self.prompt, logits.float())

    def verified(
        self,
        logits: torch.Tensor,
        rows: Sequence[int],
        committed: Sequence[Sequence[int]],
        continuations: Sequence[Sequence[Sequence[int]]],
    ) -> torch.Tensor:
        """Scores from [len(rows), n, vocab] logits: position j of ``rows[i]`` follows that
        row's ``committed`` tokens, then ``continuations[i][j]``."""
        scores = logits.float().clone()
        by_length: dict[int, list[tuple[int, int, int, list[int]]]] = {}
        for i, row in enumerate(rows):
            for j, continuation in enumerate(continuations[i]):
                tail = [*committed[row], *continuation]
                by_length.setdefault(len(tail), []).append((row, i, j, tail))
        for length, positions in by_length.items():
            by_row: dict[int, list[tuple[int, int, int, list[int]]]] = {}
            for position in positions:
                by_row.setdefault(position[0], []).append(position)
            # A call takes the next position of each row (a tree has several per length).
            for call in itertools.zip_longest(*by_row.values()):
                self._process(scores, length, [p for p in call if p is not None])
        return scores

    def _process(
        self, scores: torch.Tensor, length: int, call: list[tuple[int, int, int, list[int]]]
    ) -> None:
        """One processors call over the batch for ``call``'s positions (one per row), each
        followed by ``length`` tokens after the prompt; their scores are replaced in place."""
        batch, width = self.prompt.shape
        sequences = self.prompt.new_zeros(batch, width + length)
        sequences[:, :width] = self.prompt
        batch_scores = scores.new_zeros(batch, scores.shape[-1])
        for row, i, j, tail in call:
            sequences[row, width:] = torch.tensor(tail, dtype=sequences.dtype)
            batch_scores[row] = scores[i, j]
        processed = self.processors(sequences, batch_scores)
        for row, i, j, _ in call:
            scores[i, j] = processed[row]


@attrs.frozen
class SpeculativeRequest:
    """One ``generate()`` call handed to a speculator.

    ``input_ids`` / ``attention_mask`` [batch, prompt] (padding on either side);
    ``assistant_model``: a draft application, for draft-model speculation;
    ``prompt_lookup_num_tokens``: propose by n-gram lookup in the sequence instead;
    ``processors``: transformers' processors of the call, None when the sampler alone decides.
    ``choice`` proposes; the target's tokens come from :meth:`first_scores` /
    :meth:`chain_scores` (or ``processors.verified`` for a tree) with :attr:`target_choice`.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    max_new_tokens: int
    choice: TokenChoice
    eos_token_ids: torch.Tensor
    pad_token_id: int
    assistant_model: Any = None
    prompt_lookup_num_tokens: int | None = None
    processors: VerifiedProcessors | None = None

    @property
    def target_choice(self) -> TokenChoice:
        """How the target's token is chosen from its scores."""
        return self.choice if self.processors is None else self.choice.of_processed_scores()

    def first_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's scores of the first new token, from [batch, vocab] logits."""
        return logits if self.processors is None else self.processors.first(logits)

    def chain_scores(
        self, logits: torch.Tensor, active: torch.Tensor, rows: GeneratedRows, drafts: torch.Tensor
    ) -> torch.Tensor:
        """The target's scores of a chain: [batch, k+1, vocab] logits whose position j follows
        a row's committed tokens and its first j ``drafts`` ([batch, k]); only ``active`` rows
        are processed."""
        if self.processors is None:
            return logits
        chosen = active.nonzero().squeeze(-1).tolist()
        continuations = [[row[:j] for j in range(len(row) + 1)] for row in drafts[chosen].tolist()]
        return self._processed(logits, chosen, rows, continuations)

    def tree_scores(
        self,
        logits: torch.Tensor,
        active: torch.Tensor,
        rows: GeneratedRows,
        tokens: torch.Tensor,
        chains: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """The target's scores of a token tree: [batch, n, vocab] logits whose node j follows
        a row's committed tokens and then the tree's ``tokens`` ([batch, n]) on ``chains[j]``
        (the nodes from the root to j, the root itself being committed); only ``active`` rows
        are processed."""
        if self.processors is None:
            return logits
        chosen = active.nonzero().squeeze(-1).tolist()
        continuations = [
            [[row[node] for node in chain[1:]] for chain in chains]
            for row in tokens[chosen].tolist()
        ]
        return self._processed(logits, chosen, rows, continuations)

    def _processed(
        self,
        logits: torch.Tensor,
        chosen: list[int],
        rows: GeneratedRows,
        continuations: list[list[list[int]]],
    ) -> torch.Tensor:
        """``logits`` with the ``chosen`` rows' positions processed after their
        continuations; the other rows' left as they are."""
        assert self.processors is not None
        scores = logits.float().clone()
        processed = self.processors.verified(logits[chosen], chosen, rows.tokens, continuations)
        scores[chosen] = processed
        return scores


class Speculator(Protocol):
    """The implementation of a SpeculationMode record."""

    def __init__(self, application: NeuronBaseForCausalLM) -> None: ...

    def generate(self, request: SpeculativeRequest) -> torch.Tensor:
        """Prompt plus new tokens, [batch, prompt + generated], finished rows padded; updates
        ``application.speculation_stats``."""


@attrs.define
class AcceptanceStats:
    """Counts over target calls that verify speculated tokens, summed over the rows.

    ``row_calls``: (target call, row) pairs; ``drafted``: tokens proposed; ``accepted``: those
    the target kept; ``emitted``: tokens produced (accepted plus the target's own).
    """

    row_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    def record(self, drafted: int, accepted: torch.Tensor, emitted: torch.Tensor) -> None:
        """One target call: ``drafted`` tokens offered per row, ``accepted`` / ``emitted``
        per active row ([rows])."""
        self.row_calls += len(accepted)
        self.drafted += drafted * len(accepted)
        self.accepted += int(accepted.sum())
        self.emitted += int(emitted.sum())

    def add(self, other: AcceptanceStats) -> None:
        """Count ``other``'s calls too (to sum several generations)."""
        self.row_calls += other.row_calls
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.emitted += other.emitted

    @property
    def mean_accepted(self) -> float:
        """Speculated tokens the target accepted, per target call and row."""
        return self.accepted / self.row_calls if self.row_calls else 0.0

    @property
    def tokens_per_call(self) -> float:
        """Tokens produced per target call and row (accepted ones plus the target's own)."""
        return self.emitted / self.row_calls if self.row_calls else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "target_calls_per_row": self.row_calls,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "mean_accepted_per_call": round(self.mean_accepted, 4),
            "tokens_per_call": round(self.tokens_per_call, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
        }

    def summary(self) -> str:
        return (
            f"speculation: {self.mean_accepted:.2f} accepted tokens per target call "
            f"({self.tokens_per_call:.2f} tokens per call), acceptance rate "
            f"{self.acceptance_rate:.1%} over {self.row_calls} calls"
        )


def leading_matches(drafts: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[batch] count of leading positions where ``drafts`` equals ``targets`` ([batch, k])."""
    return (drafts == targets).long().cumprod(dim=-1).sum(dim=-1)


def greedy_acceptance(
    drafts: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the drafts the target's argmax agrees with, then the target's next token.

    ``drafts`` [batch, k], ``target_logits`` [batch, k+1, vocab] (position i scores the token
    after draft i-1). Returns ``(tokens [batch, k+1], counts [batch])``: the first ``counts``
    tokens of each row are its output (accepted drafts, then the target's token).
    """
    targets = greedy_tokens(target_logits)
    accepted = leading_matches(drafts, targets[:, :-1])
    return targets, accepted + 1


def rejection_acceptance(
    drafts: torch.Tensor,
    draft_probabilities: torch.Tensor | None,
    target_probabilities: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: the output is distributed as if sampled from the target alone.

    Draft i is kept with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection
    a token is drawn from ``max(p_i - q_i, 0)`` renormalised; when all k are kept, one more is
    drawn from ``p_k``. ``draft_probabilities`` [batch, k, vocab] is None for a deterministic
    proposer (prompt lookup), whose q is one-hot on its token. ``target_probabilities``
    [batch, k+1, vocab]. Returns ``(tokens [batch, k+1], counts [batch])`` as
    :func:`greedy_acceptance` does.
    """
    batch, k = drafts.shape
    p = target_probabilities.float()
    if draft_probabilities is None:
        q = torch.nn.functional.one_hot(drafts, p.shape[-1]).float()
    else:
        q = draft_probabilities.float()
    p_draft = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    q_draft = q.gather(-1, drafts[..., None]).squeeze(-1)
    uniform = torch.rand(batch, k, generator=generator, device=p.device)
    keep = uniform * q_draft < p_draft  # u < p/q without dividing by a zero q
    accepted = keep.long().cumprod(dim=-1).sum(dim=-1)

    rows = torch.arange(batch, device=p.device)
    residual = torch.cat([(p[:, :k] - q).clamp(min=0), p[:, k:]], dim=1)[rows, accepted]
    # A residual of zero everywhere (p == q) cannot be reached by a rejection; guard anyway.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p[rows, accepted], residual)
    last = torch.multinomial(residual, 1, generator=generator).squeeze(-1)

    tokens = torch.cat([drafts, drafts[:, :1]], dim=1).clone()
    tokens[rows, accepted] = last
    return tokens, accepted + 1


def accept(
    request: SpeculativeRequest,
    drafts: torch.Tensor,
    draft_logits: torch.Tensor | None,
    target_scores: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance rule of ``request``: greedy matching, or rejection sampling (with the
    logits ``request.choice`` drew the drafts from, or None for a proposer without a
    distribution)."""
    choice = request.choice
    if not choice.do_sample:
        return greedy_acceptance(drafts, target_scores)
    draft_probabilities = None if draft_logits is None else choice.probabilities(draft_logits)
    target_probabilities = request.target_choice.probabilities(target_scores)
    return rejection_acceptance(drafts, draft_probabilities, target_probabilities)


class GeneratedRows:
    """The new tokens of each row, committed a variable number at a time.

    A row stops at its first end-of-sequence token or at ``budget`` tokens; what a call
    produces past that is dropped. :meth:`sequences` pads finished rows with ``pad``, as
    HF transformers' ``generate()`` does.
    """

    def __init__(
        self, batch: int, budget: int, eos: torch.Tensor, pad: int, device: torch.device
    ) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.finished = [False] * batch
        self.budget = budget
        self.eos = set(eos.tolist())
        self.pad = pad
        self.device = device

    @property
    def done(self) -> bool:
        return all(self.finished)

    @property
    def active(self) -> torch.Tensor:
        """[batch] bool: rows still generating."""
        return torch.tensor([not f for f in self.finished], device=self.device)

    def commit(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Append the first ``counts[b]`` of ``tokens[b]`` to each active row; returns how
        many each row actually took ([batch], 0 for finished rows)."""
        taken = [0] * len(self.tokens)
        rows = zip(tokens.tolist(), counts.tolist(), strict=True)
        for row, (row_tokens, count) in enumerate(rows):
            if self.finished[row]:
                continue
            for token in row_tokens[:count]:
                self.tokens[row].append(token)
                taken[row] += 1
                if token in self.eos or len(self.tokens[row]) >= self.budget:
                    self.finished[row] = True
                    break
        return torch.tensor(taken, device=self.device)

    def last_tokens(self) -> torch.Tensor:
        """[batch] each row's newest token (the pad for a row with none)."""
        last = [row[-1] if row else self.pad for row in self.tokens]
        return torch.tensor(last, device=self.device)

    def sequences(self, prompt: torch.Tensor) -> torch.Tensor:
        """``prompt`` [batch, length] followed by each row's tokens, padded to the longest."""
        width = max(len(row) for row in self.tokens)
        padded = [row + [self.pad] * (width - len(row)) for row in self.tokens]
        new = torch.tensor(padded, dtype=prompt.dtype, device=prompt.device)
        return torch.cat([prompt, new], dim=1)
