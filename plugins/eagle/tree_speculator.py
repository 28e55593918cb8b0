"""EagleTreeSpeculator: a whole ``generate()`` with fused EAGLE drafting a token tree.

The context call and the pending pairs are the chain's (:mod:`nxdplug.plugins.eagle.speculator`);
each speculation call drafts and verifies a tree (:mod:`nxdplug.plugins.eagle.tree`). The host
chooses the target's token after every node (its argmax, or a draw from its processed
distribution when sampling) and keeps the deepest node whose path agrees with the choice at
each parent. Children of a node hold distinct tokens (a top-k), so this is decoding token by
token from the target that skips the calls whose token the tree had guessed: greedy output is
the target's, and sampled output is distributed as the target's.

The kept path's target cache rows move to consecutive positions; the path's tokens (after
the root) and the target's token at its end are the row's new tokens and its next pending
pairs, with the target's features at the path's nodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nxdplug.plugin_api import SpeculativeRequest, StepInputs
from nxdplug.plugins.eagle.speculator import EagleSpeculator

if TYPE_CHECKING:
    from nxdplug.plugin_api import NeuronBaseForCausalLM


class EagleTreeSpeculator(EagleSpeculator):
    """The ``eagle`` speculation mode's implementation when ``token_tree_config`` is set."""

    def __init__(self, application: NeuronBaseForCausalLM) -> None:
        super().__init__(application)
        self.tree = self.speculation.tree.on(application.device)
        # The target writes n tree slots after the newest committed token, as k = n - 1
        # chain drafts would.
        self.k = self.tree.num_drafted

    def generate(self, request: SpeculativeRequest) -> torch.Tensor:
        app, tree = self.application, self.tree
        rows, seq_ids, pending = self._begin(request, tree.depth)
        if pending is None:
            return rows.sequences(request.input_ids)
        stats = app.speculation_stats
        pending_tokens, pending_features, pending_positions, pending_count = pending
        batch, device = pending_tokens.shape[0], pending_tokens.device
        choose = request.target_choice.choose
        steps = torch.arange(tree.depth, device=device)
        kv_mgr = app.loaded_model.kv_mgr
        picked = torch.arange(batch, device=device)
        while not rows.done:
            step = StepInputs(
                pending_tokens,
                torch.ones_like(pending_tokens),  # the wrapper widens it to the bucket
                pending_positions,
                seq_ids,
                {"pending_features": pending_features, "pending_count": pending_count},
            )
            candidates, target_logits, features = self.speculation(step)
            active = rows.active
            scores = request.tree_scores(target_logits, active, rows, candidates, tree.node_chains)
            targets = choose(scores.flatten(0, 1)).view(candidates.shape)
            best, accepted = tree.accept(candidates, targets)
            path = tree.path_to(best)  # [batch, depth], padded by repeating the kept node
            new_tokens = candidates.gather(1, path[:, 1:].clamp(min=0))
            new_tokens = torch.cat([new_tokens, new_tokens[:, :1]], dim=1)
            new_tokens[picked, accepted] = targets[picked, best]
            counts = accepted + 1
            rows.commit(new_tokens, counts)
            stats.record(tree.num_drafted, accepted[active], counts[active])

            going_on = rows.active
            base = pending_positions.gather(1, (pending_count - 1)[:, None])  # t = L-2
            slots = base + 1  # the root's target slot, L-1
            moved = seq_ids[going_on], (slots + path)[going_on], (slots + steps)[going_on]
            kv_mgr.move_positions(*moved)
            keep = going_on[:, None]
            path_features = features.gather(1, path[..., None].expand(-1, -1, features.shape[-1]))
            pending_tokens = torch.where(keep, new_tokens, pending_tokens)
            pending_features = torch.where(keep[..., None], path_features, pending_features)
            pending_positions = torch.where(keep, slots + steps, pending_positions)
            pending_count = torch.where(going_on, counts, pending_count)
        return rows.sequences(request.input_ids)
