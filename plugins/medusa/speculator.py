"""Medusa decoding: one target call per step verifies a whole tree of head proposals.

Per row, the cache holds the committed tokens at positions ``0..length-1``; the root (the
target's own next token) is known but not yet in the cache. A step:

1. tree tokens: the root, then each node's token from the heads' top-k at the last committed
   token (head i proposes depth i+1, i.e. token t+i+2);
2. one call of the tree verifier writes node j at slot ``length + j`` (rotary position
   ``length + depth``), each node seeing the committed prefix, its ancestors and itself;
3. acceptance: the target chooses a token at every node (its argmax, or a draw from its
   processed distribution when sampling); the deepest node whose path agrees, node by node,
   with the target's choice at the parent is kept; the root and the accepted nodes are emitted,
   and the target's choice at the last accepted node is the next root. Siblings hold distinct
   tokens, so this is decoding token by token from the target that skips the calls whose
   token the tree had guessed: greedy output is the target's, and sampled output is
   distributed as the target's;
4. the accepted path's K/V move to ``length..length+accepted`` (``move_positions``), and the
   next tree comes from the heads at the last accepted node.

Rows keep their own lengths; finished rows leave the batch (the wrapper pads it).
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
    StepInputs,
    compact_left,
    positions_from_mask,
)
from nxdplug.plugins.medusa.submodels import MEDUSA_CONTEXT_TAG, MEDUSA_MODEL_TAG

if TYPE_CHECKING:
    from nxdplug.plugin_api import NeuronBaseForCausalLM


class MedusaSpeculator:
    """The ``medusa`` speculation mode (greedy)."""

    def __init__(self, application: NeuronBaseForCausalLM) -> None:
        self.application = application
        self.context = application.submodel(MEDUSA_CONTEXT_TAG)
        self.verifier = application.submodel(MEDUSA_MODEL_TAG)
        self.tree = self.verifier.tree.on(application.device)
        # Each node's path from the root (inclusive), for the processors' sequences.
        self.node_paths = [
            path[: depth + 1]
            for path, depth in zip(self.tree.paths.tolist(), self.tree.depth.tolist(), strict=True)
        ]

    def _check(self, request: SpeculativeRequest, prompt_length: int) -> None:
        # The feature guide passes the Medusa model itself as assistant_model.
        own = request.assistant_model in (None, self.application)
        if not own or request.prompt_lookup_num_tokens:
            raise NotSupportedError(
                "a Medusa model proposes with its own heads: drop assistant_model (or pass the "
                "model itself, as NxD Inference does) and prompt_lookup_num_tokens"
            )
        seq_len = self.verifier.buckets[-1]
        needed = prompt_length + request.max_new_tokens + self.tree.size - 1
        if needed > seq_len:
            raise NxdPlugError(
                f"Medusa writes the whole tree ({self.tree.size} tokens) after the last "
                f"committed token: a prompt of {prompt_length} tokens with max_new_tokens="
                f"{request.max_new_tokens} needs seq_len >= {needed} (it is {seq_len}); raise "
                "seq_len or generate fewer tokens"
            )

    def generate(self, request: SpeculativeRequest) -> torch.Tensor:
        app, tree = self.application, self.tree
        tokens, mask, positions = compact_left(
            request.input_ids, request.attention_mask, positions_from_mask(request.attention_mask)
        )
        lengths = mask.sum(dim=-1)
        self._check(request, int(lengths.max()))
        stats = app.speculation_stats = AcceptanceStats()
        app.reset()
        batch = tokens.shape[0]
        device = tokens.device
        seq_ids = torch.arange(batch, device=device)
        base_logits, top = self.context(StepInputs(tokens, mask, positions, seq_ids))
        choose = request.target_choice.choose
        roots, top = choose(request.first_scores(base_logits[:, -1])), top[:, -1]
        rows = GeneratedRows(
            batch, request.max_new_tokens, request.eos_token_ids, request.pad_token_id, device
        )
        kv_mgr = app.loaded_model.kv_mgr
        steps = torch.arange(tree.max_depth + 1, device=device)
        while not rows.done:
            active = rows.active.nonzero().squeeze(-1)
            prefix = lengths[active]
            candidates = tree.candidates(roots[active], top[active])
            tree_mask = tree.attention_mask(prefix, int(prefix.max()) + tree.size)
            slots = prefix[:, None] + torch.arange(tree.size, device=device)
            logits, node_top = self.verifier(
                StepInputs(candidates, tree_mask, slots, seq_ids[active])
            )
            scores = self._scores(request, logits, active, rows, candidates)
            targets = choose(scores.flatten(0, 1)).view(logits.shape[:2])
            best, accepted = tree.accept(candidates, targets)
            path = tree.paths[best]
            emitted = torch.zeros(batch, tree.max_depth + 1, dtype=tokens.dtype, device=device)
            counts = torch.zeros(batch, dtype=torch.long, device=device)
            emitted[active] = candidates.gather(1, path).to(tokens.dtype)
            counts[active] = accepted + 1
            taken = rows.commit(emitted, counts)[active]
            stats.record(tree.num_nodes, torch.minimum(accepted, taken - 1).clamp(min=0), taken)
            kv_mgr.move_positions(seq_ids[active], prefix[:, None] + path, prefix[:, None] + steps)
            picked = torch.arange(len(active), device=device)
            lengths[active] = prefix + accepted + 1
            roots[active] = targets[picked, best]
            top[active] = node_top[picked, best]
        app.reset()
        return rows.sequences(request.input_ids)

    def _scores(
        self,
        request: SpeculativeRequest,
        logits: torch.Tensor,
        active: torch.Tensor,
        rows: GeneratedRows,
        candidates: torch.Tensor,
    ) -> torch.Tensor:
        """The target's scores at each node: node j follows the row's committed tokens, then
        the candidates on the path from the root to j."""
        if request.processors is None:
            return logits
        continuations = [
            [[row[node] for node in path] for path in self.node_paths]
            for row in candidates.tolist()
        ]
        return request.processors.verified(logits, active.tolist(), rows.tokens, continuations)
