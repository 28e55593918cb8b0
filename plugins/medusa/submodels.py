"""The two sub-models Medusa adds: a context encoding that also runs the heads, and the tree
verifier.

Both return, besides the base LM head's logits, the token ids of each head's top-k (k: the
widest rank the tree uses), computed in the graph so that only ``[rows, tokens, heads, k]``
ids leave it rather than ``heads x vocab`` logits per token.

- Context encoding (``medusa_context_encoding_model``): the prompt, as the core context
  encoding runs it; returns the last token's base logits (the first new token) and its heads'
  candidates (the first tree). Medusa needs the heads at the prompt's last token, which the
  core context encoding does not give, hence this phase rather than a wasted first tree step.
- Verification (``medusa_speculation_model``): the root and the tree's nodes with the 3-D tree
  mask; returns base logits and head candidates at every node, since the next step starts from
  whichever node is accepted last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from nxdplug.plugin_api import ModelWrapper, StepInputs, last_token_states, tree_attention
from nxdplug.plugins.medusa.tree import MedusaTree

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

MEDUSA_CONTEXT_TAG = "medusa_context_encoding_model"

# NxD Inference's tag of the verification phase.
MEDUSA_MODEL_TAG = "medusa_speculation_model"


def head_candidates(model: nn.Module, hidden: torch.Tensor, top_k: int) -> torch.Tensor:
    """[batch, seq, heads, top_k] ids of each head's best tokens at ``hidden`` [batch, seq, h]."""
    logits = torch.stack([head(hidden) for head in model.medusa_head], dim=2)
    return logits.topk(top_k, dim=-1).indices


class MedusaPhase(nn.Module):
    """Tokens in; base logits (float32) and head candidates [batch, n, heads, top_k] out, for
    the prompt's last token (``last_token_only``, context encoding: n = 1) or for every input
    token (the tree's nodes, under a 3-D mask)."""

    def __init__(self, model: nn.Module, top_k: int, last_token_only: bool) -> None:
        super().__init__()
        self.model = model
        self.top_k = top_k
        self.last_token_only = last_token_only

    def forward(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        if self.last_token_only:
            hidden = self.model.hidden_states(step)
            hidden = last_token_states(hidden, step.attention_mask)
        else:
            masks, rotary_positions = tree_attention(self.model, step.attention_mask)
            hidden = self.model.hidden_states(step, masks, rotary_positions)
        return self.model.lm_head(hidden).float(), head_candidates(self.model, hidden, self.top_k)


class MedusaContextWrapper(ModelWrapper):
    """Context-encoding buckets and batch size (``max_context_length``, ``ctx_batch_size``)
    under its own tag, so it compiles beside the core context encoding. Medusa chooses tokens
    on the host, so the phase takes no sampling inputs."""

    takes_step_inputs = False

    def __init__(
        self, config: InferenceConfig, model_cls: type[nn.Module], tree: MedusaTree
    ) -> None:
        super().__init__(config, model_cls, tag=MEDUSA_CONTEXT_TAG, is_context_encoding=True)
        self.tree = tree

    def phase_module(self, model: nn.Module) -> nn.Module:
        return MedusaPhase(model, self.tree.top_k, last_token_only=True)


class MedusaTreeWrapper(ModelWrapper):
    """Verifies ``tree.size`` tokens per row with a [batch, n, bucket] tree mask."""

    takes_step_inputs = False

    def __init__(
        self, config: InferenceConfig, model_cls: type[nn.Module], tree: MedusaTree
    ) -> None:
        # tokens_per_step 0: only the speculator calls it (application.forward never routes here).
        super().__init__(
            config,
            model_cls,
            tag=MEDUSA_MODEL_TAG,
            tokens_per_step=0,
            batch_size=config.neuron_config.spec_batch_size,
        )
        self.tree = tree

    def phase_module(self, model: nn.Module) -> nn.Module:
        return MedusaPhase(model, self.tree.top_k, last_token_only=False)

    def input_generator(self) -> list[StepInputs]:
        batch, n, device = self.batch_size, self.tree.size, self.device
        tree = self.tree.on(device)
        inputs = []
        for bucket in self.buckets:
            prefix = torch.full((batch,), bucket - n, device=device)
            inputs.append(
                StepInputs(
                    torch.zeros(batch, n, dtype=torch.long, device=device),
                    tree.attention_mask(prefix, bucket),
                    (prefix[:, None] + torch.arange(n, device=device)).contiguous(),
                    torch.arange(batch, dtype=torch.long, device=device),
                )
            )
        return inputs
