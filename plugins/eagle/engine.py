"""Fused EAGLE in the serving engine (vLLM's ``eagle`` and ``eagle3`` methods).

The engine encodes a request's prompt by the fused context phase (the target, and the draft
over the prompt's pairs), and each step runs the fused speculation phase for its requests:
the draft encodes each request's pending pairs, drafts k tokens greedily (or, with
``token_tree_config``, a token tree level by level), and the target scores them. The engine
takes the tokens as from any verification (each position chosen as a decode step chooses it,
going on while the draft holds the chosen token), and the tokens a request took become its
next pending pairs, with the target's features at the nodes they were chosen at (see
:mod:`nxdplug.plugins.eagle.speculator` for the pairs). A tree's kept path first moves to
consecutive positions of the target's cache (the draft's needs no move: its pairs are
encoded again).
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
    TokenTree,
    chain_length,
    sorted_paths,
    tree_config_of_paths,
    tree_nodes,
)
from nxdplug.plugins.eagle.fused import EAGLE_CONTEXT_TAG

if TYPE_CHECKING:
    from nxdplug.plugin_api import EveryRank, NeuronBaseForCausalLM


def engine_settings(config: SpeculativeConfig) -> dict[str, Any]:
    """The model vLLM's ``eagle`` and ``eagle3`` methods need: the draft of ``model`` fused into
    the target (its graphs draft and verify; no one-token phase), an EAGLE-3 head for
    ``eagle3``, and the token tree of ``speculative_token_tree`` (NxD Inference's
    ``token_tree_config``, whose ``speculation_length`` counts the root too). The command
    line's EAGLE extension attaches the draft."""
    if config.model is None:
        raise ConfigError(
            ["method 'eagle' needs 'model', the EAGLE draft's folder"],
            source="--speculative-config",
        )
    settings = {
        "enable_eagle_speculation": True,
        "enable_fused_speculation": True,
        "trace_tokengen_model": False,
        "is_eagle3": config.method == "eagle3",
    }
    if config.speculative_token_tree is not None:
        tree = draft_tree(config.speculative_token_tree)
        settings |= {"token_tree_config": tree.tree_config, "speculation_length": tree.node_nums}
    return settings


def draft_tree(paths: Sequence[Sequence[int]]) -> TokenTree:
    """The token tree of vLLM's ``speculative_token_tree``. EAGLE drafts a node's children as
    its draft's best tokens in rank order, so the ranks under each node must be 0, 1, ..."""
    tree = TokenTree(tree_config_of_paths(paths))
    if tree.rank_paths() != sorted_paths(paths):
        raise ConfigError(
            [
                f"speculative_token_tree {[tuple(p) for p in paths]}: EAGLE drafts a node's "
                "children as its draft's best tokens in rank order, so the ranks under each "
                "node must be 0, 1, 2, ... with none left out"
            ],
            source="--speculative-config",
        )
    return tree


@attrs.define
class PendingPairs:
    """A request's pairs ``(x_{t+1}, f_t)`` the draft has not encoded with real features
    yet: the first at ``t = start``, ``count`` of them; ``tokens`` None right after the
    prompt (its one pair's token is the request's first, chosen after the prompt phase),
    ``features`` [width, hidden]. ``scored``: the target's features of the last
    verification ([k+1 or the tree's nodes, hidden]), until the engine says what the request
    took."""

    tokens: list[int] | None
    features: torch.Tensor
    start: int
    count: int
    scored: torch.Tensor | None = None


class EagleEngineSpeculator:
    """The ``engine_fused`` of the ``eagle`` speculation mode. Its phases run on every rank
    (``every_rank``); the pending pairs stay with the engine's rank."""

    def __init__(
        self,
        application: NeuronBaseForCausalLM,
        config: SpeculativeConfig,
        draft: NeuronBaseForCausalLM | None,
        every_rank: EveryRank,
    ) -> None:
        problems = []
        if draft is not None:
            problems.append("EAGLE drafts with the draft fused into the model: give no draft")
        is_eagle3 = bool(application.neuron_config.is_eagle3)
        if (config.method == "eagle3") != is_eagle3:
            built = "an EAGLE-3 draft (is_eagle3=True)" if is_eagle3 else "an EAGLE-1 draft"
            wanted = "eagle3" if is_eagle3 else "eagle"
            problems.append(
                f"method {config.method!r}: the model was built with {built}; use method {wanted!r}"
            )
        if problems:
            raise ConfigError(problems, source="the engine's speculative_config")
        self.every_rank = every_rank
        self.device = application.submodel(EAGLE_CONTEXT_TAG).device
        self.k = application.neuron_config.speculation_length
        self.vocab_size = application.config.vocab_size
        tree = getattr(application.submodel(FUSED_SPECULATION_MODEL_TAG), "tree", None)
        self.tree = None if tree is None else tree.on(application.device)
        if self.tree is None:
            if config.speculative_token_tree is not None:
                tree_nodes(config, [(0,) * depth for depth in range(1, self.k + 1)])
            self.draft_depth = chain_length(config, self.k)
            self.width = self.k + 1  # pending pairs a row: the drafts and the target's token
            # The target scores up to k positions past the last token (see EagleSpeculator).
            self.positions_past_end = self.k - 1
        else:
            self.parents = self.tree.parent[1:].tolist()
            tree_nodes(config, self.tree.rank_paths())
            self.draft_depth = self.tree.depth - 1
            self.width = self.tree.depth  # a path's tokens and the target's
            # The target scores the tree's n nodes from the last token's position on.
            self.positions_past_end = self.tree.node_nums - 2
        application.reset()

    def encode(self, requests: Sequence[Request], step: ScheduledStep) -> CausalLMOutputWithTokens:
        inputs = StepInputs(step.input_ids, step.cache_mask(), step.positions(), step.seq_ids)
        logits, feature = self.every_rank.submodel(EAGLE_CONTEXT_TAG, inputs)
        for row, request in enumerate(requests):
            features = feature.new_zeros(self.width, feature.shape[-1])
            features[0] = feature[row, 0]
            start = int(step.num_new[row]) - 1  # (x_P, f_{P-1}): t = P-1
            request.proposer_state = PendingPairs(None, features, start, 1)
        return CausalLMOutputWithTokens(logits=logits, tokens=None)

    def verify(self, requests: Sequence[Request]) -> tuple[list[DraftTree], torch.Tensor]:
        rows, width = len(requests), self.width
        device = self.device
        pairs: list[PendingPairs] = [r.proposer_state for r in requests]
        tokens = torch.zeros(rows, width, dtype=torch.long, device=device)
        for row, (request, pending) in enumerate(zip(requests, pairs, strict=True)):
            given = pending.tokens if pending.tokens is not None else request.output_ids[-1:]
            tokens[row, : len(given)] = torch.tensor(given)
        offsets = torch.arange(width, device=device)
        starts = torch.tensor([p.start for p in pairs], device=device)
        extra = {
            "pending_features": torch.stack([p.features for p in pairs]),
            "pending_count": torch.tensor([p.count for p in pairs], device=device),
        }
        if self.tree is None:
            extra["draft_noise"] = torch.zeros(rows, self.k, self.vocab_size, device=device)
            extra["inv_temperature"] = torch.ones(rows, 1, device=device)
        step = StepInputs(
            tokens,
            torch.ones_like(tokens),  # the wrapper widens it to the bucket
            starts[:, None] + offsets,
            torch.tensor([r.line for r in requests], device=device),
            extra,
        )
        if self.tree is None:
            drafts, _, target_logits, features = self.every_rank.submodel(
                FUSED_SPECULATION_MODEL_TAG, step
            )
            proposed = [DraftTree.chain(row[: self.draft_depth]) for row in drafts.tolist()]
        else:
            candidates, target_logits, features = self.every_rank.submodel(
                FUSED_SPECULATION_MODEL_TAG, step
            )
            proposed = [DraftTree(row[1:], self.parents) for row in candidates.tolist()]
        for pending, scored in zip(pairs, features, strict=True):
            pending.scored = scored
        return proposed, target_logits

    def taken(self, requests: Sequence[Request], paths: Sequence[Sequence[int]]) -> None:
        roots = []
        for request, path in zip(requests, paths, strict=True):
            pending: PendingPairs = request.proposer_state
            assert pending.scored is not None
            start = pending.start + pending.count  # after the newest pending pair
            roots.append(start)  # t = L-1, the newest committed token's target position
            features = pending.scored
            if self.tree is not None:
                index = torch.tensor(path, device=features.device)
                kept = features.new_zeros(self.width, features.shape[-1])
                kept[: len(path)] = features[index]
                features = kept
            taken = request.output_ids[-len(path) :]
            request.proposer_state = PendingPairs(taken, features, start, len(path))
        if self.tree is not None:
            going_on = [i for i, r in enumerate(requests) if not r.finished]
            self.every_rank.move_kept_paths(
                [requests[i].line for i in going_on],
                [roots[i] for i in going_on],
                [paths[i] for i in going_on],
            )
