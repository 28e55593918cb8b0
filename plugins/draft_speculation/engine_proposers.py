"""The serving engine's proposers of draft-model speculation: vLLM's ``ngram`` and
``draft_model`` methods (see :mod:`nxdplug.engine.speculative` for how the engine verifies).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from nxdplug.plugin_api import (
    ConfigError,
    EveryRank,
    Proposer,
    Request,
    ScheduledStep,
    SpeculativeConfig,
    draft_ranks,
    greedy_tokens,
)
from nxdplug.plugins.draft_speculation.proposers import is_application

if TYPE_CHECKING:
    from nxdplug.plugin_api import NeuronBaseForCausalLM


def engine_proposer(
    application: NeuronBaseForCausalLM,
    config: SpeculativeConfig,
    draft: NeuronBaseForCausalLM | None,
    every_rank: EveryRank,
) -> Proposer:
    """The proposer of ``config.method``."""
    if config.method == "ngram":
        if draft is not None:
            raise ConfigError(["method 'ngram' looks tokens up: drop the draft model"])
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    ranks = draft_ranks(config, application.neuron_config.tp_degree)
    return DraftProposer(application, draft, ranks, every_rank)


class NgramProposer:
    """The tokens that followed the latest earlier occurrence of a request's last n tokens,
    for the longest n from ``max_n`` down to ``min_n`` that occurs earlier (vLLM's ``ngram``
    method, ``prompt_lookup_min`` / ``prompt_lookup_max``); nothing when none does."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence[Request], k: int) -> list[list[int]]:
        return [self.lookup(request.token_ids, k) for request in requests]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for size in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-size:]
            # The latest start before the suffix's own, so that something follows it.
            for start in range(len(tokens) - size - 1, -1, -1):
                if tokens[start : start + size] == suffix:
                    return tokens[start + size : start + size + k]
        return []


@attrs.define
class DraftState:
    """What a draft's cache line holds for a request: its first ``valid`` tokens, then the
    ``fed`` tokens from position ``valid`` on (the last verification's; those the target
    kept are still right)."""

    valid: int
    fed: list[int]

    def held(self, tokens: Sequence[int]) -> int:
        """How many of the request's leading ``tokens`` the draft's line holds."""
        kept = 0
        for fed, token in zip(self.fed, tokens[self.valid :], strict=False):
            if fed != token:
                break
            kept += 1
        return self.valid + kept


class DraftProposer:
    """A smaller causal LM's greedy tokens (vLLM's ``draft_model`` method), from its own KV
    cache: the request's line of the target is its line in the draft too.

    A request's first proposal encodes its tokens so far (all but the last) into the draft's
    line; later ones catch up on the one token the draft lacks when the target kept every
    proposal. A request that cannot be encoded (its tokens exceed the draft's
    ``max_context_length``, after a preemption) gets no proposals.

    With tensor parallelism the draft runs on ``ranks`` ranks: the target's (each holds a
    shard of it and runs its steps with the others, through ``every_rank``), or the first
    alone (built whole, ``tp_degree`` 1).
    """

    def __init__(
        self,
        application: NeuronBaseForCausalLM,
        draft: NeuronBaseForCausalLM,
        ranks: int,
        every_rank: EveryRank,
    ) -> None:
        target = application.neuron_config
        problems = []
        if draft is None:
            raise ConfigError(
                ["method 'draft_model' needs the draft model (nxdplug serve: 'model')"],
                source="the engine's speculative_config",
            )
        if not is_application(draft):
            problems.append(f"the draft must be an nxdplug application, not {type(draft)}")
        else:
            nc = draft.neuron_config
            if draft.config.vocab_size != application.config.vocab_size:
                problems.append(
                    f"the draft's vocabulary ({draft.config.vocab_size} tokens) differs from "
                    f"the target's ({application.config.vocab_size}); it must share the "
                    "target's tokenizer"
                )
            if not nc.is_continuous_batching or nc.max_batch_size < target.max_batch_size:
                problems.append(
                    "the draft keeps a cache line per request of the target: build it with "
                    f"is_continuous_batching=True and batch_size >= {target.max_batch_size}"
                )
            if nc.tp_degree != ranks:
                alone = (
                    " (or give draft_tensor_parallel_size 1: the first rank runs it alone)"
                    if nc.tp_degree == 1
                    else ""
                )
                problems.append(
                    f"the draft is built for tp_degree {nc.tp_degree}, but runs on {ranks} "
                    "rank(s) (draft_tensor_parallel_size; by default the target's tp_degree, "
                    f"{target.tp_degree}): build it with tp_degree {ranks}{alone}"
                )
            if nc.seq_len < target.seq_len:
                problems.append(f"the draft's seq_len {nc.seq_len} is below the target's")
            if getattr(nc, "is_block_kv_layout", False) or nc.on_device_sampling_config:
                problems.append(
                    "the draft keeps lines of its own and gives logits: build it without "
                    "is_block_kv_layout and on_device_sampling_config"
                )
        if problems:
            raise ConfigError(problems, source="the draft model")
        self.draft = draft
        self.ranks = every_rank.of(draft) if ranks == target.tp_degree else EveryRank.here(draft)
        self.max_prompt = draft.neuron_config.max_context_length
        self.ctx_rows = draft.neuron_config.ctx_batch_size
        self.tkg_rows = draft.neuron_config.tkg_batch_size
        draft.reset()

    def propose(self, requests: Sequence[Request], k: int) -> list[list[int]]:
        ready = self._catch_up(requests)
        if not ready:
            return [[] for _ in requests]
        tokens = [[r.token_ids[-1]] for r in ready]
        positions = [r.length - 1 for r in ready]
        drafted: list[list[int]] = [[] for _ in ready]
        for step in range(k):
            tokens = [[t] for t in self._greedy(ready, tokens, [p + step for p in positions])]
            for row, token in enumerate(tokens):
                drafted[row] += token
        for request, proposal in zip(ready, drafted, strict=True):
            fed = [request.token_ids[-1], *proposal[:-1]]
            request.proposer_state = DraftState(request.length - 1, fed)
        proposals = {id(r): d for r, d in zip(ready, drafted, strict=True)}
        return [proposals.get(id(r), []) for r in requests]

    def _catch_up(self, requests: Sequence[Request]) -> list[Request]:
        """Bring each request's draft line to all its tokens but the last; the requests
        whose line is there."""
        encode, one_behind, ready = [], [], []
        for request in requests:
            state = request.proposer_state
            held = 0 if state is None else min(state.held(request.token_ids), request.length - 1)
            if held == request.length - 1:
                ready.append(request)
            elif held == request.length - 2:
                one_behind.append(request)
            elif request.length - 1 <= self.max_prompt:
                encode.append(request)
        for start in range(0, len(encode), self.ctx_rows):
            rows = encode[start : start + self.ctx_rows]
            self._run(rows, [r.token_ids[:-1] for r in rows], [0] * len(rows))
        if one_behind:
            self._run(
                one_behind,
                [[r.token_ids[-2]] for r in one_behind],
                [r.length - 2 for r in one_behind],
            )
        for request in encode + one_behind:
            request.proposer_state = DraftState(request.length - 1, [])
        return [r for r in requests if r in ready or r in encode or r in one_behind]

    def _greedy(
        self, rows: list[Request], tokens: list[list[int]], positions: list[int]
    ) -> list[int]:
        """The draft's argmax after one new token per row at ``positions``."""
        logits = self._run(rows, tokens, positions)
        return greedy_tokens(logits).tolist()

    def _run(
        self, rows: list[Request], tokens: list[list[int]], positions: list[int]
    ) -> torch.Tensor:
        """One draft step (``tkg_batch_size`` rows a call) of new tokens over the rows'
        cached ``positions``; each row's last logits [rows, vocab]."""
        size = self.tkg_rows if positions[0] else self.ctx_rows
        logits = []
        for start in range(0, len(rows), size):
            part = slice(start, start + size)
            step = ScheduledStep.from_rows(
                tokens[part],
                positions[part],
                [r.line for r in rows[part]],
                device=self.draft.device,
            )
            logits.append(self.ranks.run(step).logits[:, -1])
        return torch.cat(logits)
