"""Fused EAGLE with a draft token tree (NxD Inference's ``token_tree_config``).

The chain's phase (:mod:`nxdplug.plugins.eagle.fused`) drafts one token per step; this one
drafts a tree level by level and the target verifies every node in the same call. Per row, with
``base`` the draft position t of the newest pending pair (L-2 for L committed tokens):

1. the draft encodes the pending pairs, as in the chain; its prediction at the last of them
   is the root's (the root is x_{L-1}, the newest committed token);
2. level by level, each node's children are its draft's best tokens (the draft's scores at the
   node's predicted feature, top ``children`` in rank order); a node at depth d >= 1 is then
   encoded as the pair (its token, its parent's predicted feature) at rotary position
   ``base + d``, written at draft cache slot ``base + node``, seeing the slots up to
   ``base`` and its ancestors' (the last level is never encoded: nothing drafts from it);
3. the target scores ``[x_{L-1}, nodes...]`` written at slots ``L-1 + node``, at rotary
   positions ``L-1 + depth``, each node seeing the committed prefix and its ancestors.

The speculator then follows the target: it keeps the deepest node whose path agrees with the
target's choice at every parent, moves that path's target cache rows to consecutive positions,
and the path's tokens become the next pending pairs (with the target's features at the nodes
before them). The draft cache needs no move: the pending pairs are rewritten at consecutive
positions, and the tree's slots are written again before the next tree reads them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from nxdplug.plugin_api import ModelWrapper, StepInputs, TokenTree, tree_attention
from nxdplug.plugins.eagle.fused import EagleSpeculationWrapper, gather_rows

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, PipelineContext


class EagleTreePhase(nn.Module):
    """Re-encode the pending pairs, draft the tree, verify it with the target: one graph."""

    def __init__(self, model: nn.Module, tree: TokenTree) -> None:
        super().__init__()
        self.model = model
        self.tree = tree

    def forward(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One tree step.

        The step's tokens and positions [batch, depth] are the pending pairs' (up to ``depth``
        of them: a path's tokens plus the target's own), with ``step["pending_features"]``
        [batch, depth, hidden] and ``step["pending_count"]`` [batch]; the ``attention_mask``
        [batch, keys] is all ones over a bucket that holds every slot this step writes.

        Returns the tree's tokens [batch, n] (the root first, then the nodes by id), the
        target's logits [batch, n, vocab] (float32) and features [batch, n, hidden].
        """
        tree, draft = self.tree, self.model.eagle_draft
        pending_tokens, pending_positions = step.input_ids, step.position_ids
        attention_mask, seq_ids = step.attention_mask, step.seq_ids
        last = step["pending_count"] - 1
        predicted = draft(
            pending_tokens, step["pending_features"], attention_mask, pending_positions, seq_ids
        )
        base = pending_positions.gather(1, last[:, None])  # [batch, 1]
        width = attention_mask.shape[-1]
        draft_sees = tree.attention_mask(base[:, 0], width)  # [batch, n, width]
        depth = tree.rotary_position_id_offset
        hidden = gather_rows(predicted, last)  # the root's predicted feature
        tokens = [pending_tokens.gather(1, last[:, None])]
        for level, nodes in enumerate(tree.level_node_ids[:-1]):
            if level > 0:
                ids = torch.tensor(nodes, device=base.device)
                hidden = draft(
                    tokens[-1],
                    hidden,
                    attention_mask,
                    base + ids,
                    seq_ids,
                    tree_mask=draft_sees[:, nodes],
                    rotary_positions=base + depth[ids],
                )
            logits = draft.token_logits(hidden)
            widest = max(tree.level_child[level])
            best = logits.topk(widest, dim=-1).indices.flatten(1)  # [batch, nodes * widest]
            tokens.append(best[:, tree.topk_permute_index[level]])
            hidden = hidden[:, tree.draft_hidden_gather_index[level]]
        candidates = torch.cat(tokens, dim=1)
        target_prefix = base[:, 0] + 1
        masks, rotary = tree_attention(self.model, tree.attention_mask(target_prefix, width))
        slots = target_prefix[:, None] + torch.arange(tree.node_nums, device=base.device)
        final, features = draft.target_features(
            self.model, StepInputs(candidates, attention_mask, slots, seq_ids), masks, rotary
        )
        return candidates, self.model.lm_head(final).float(), features


class EagleTreeWrapper(EagleSpeculationWrapper):
    """The fused speculation sub-model of a tree: a path's pending pairs in, the tree's n
    nodes written past the newest pair's slot, no sampling inputs (the target draws at the
    nodes on the host)."""

    extra_input_names = ("pending_features", "pending_count")

    def __init__(
        self, config: InferenceConfig, model_cls: type[nn.Module], tree: TokenTree
    ) -> None:
        super().__init__(config, model_cls)
        self.tree = tree

    @property
    def pending_width(self) -> int:
        return self.tree.depth

    @property
    def writes_past(self) -> int:
        return self.tree.node_nums

    def phase_module(self, model: nn.Module) -> nn.Module:
        return EagleTreePhase(model, self.tree.on(self.device))

    def sampling_inputs(self, batch: int) -> dict[str, torch.Tensor]:
        return {}


def add_tree_submodel(context: PipelineContext) -> ModelWrapper:
    """The tree's fused speculation sub-model, for ``token_tree_config``."""
    tree = TokenTree(context.neuron_config.token_tree_config)
    return EagleTreeWrapper(context.config, context.model_cls, tree)
