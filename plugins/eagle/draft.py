"""The EAGLE-1 draft model (SafeAILab/EAGLE ``cnets1.Model``, flat chain, no tree).

One draft step at draft position t takes the pair ``(x_{t+1}, f_t)``: the embedding of the next
token and the target's feature at t (its final norm's output, the LM head's input), and
predicts the feature ``f_{t+1}``; ``lm_head(prediction)`` (no norm) scores the token after.

    h = fc(cat(embed(x_{t+1}), f_t))           # [2h] -> [h], with bias
    h = h + attn(input_norm(h))                 # input_norm is the identity unless
    h = h + mlp(post_attention_norm(h))         #   enable_eagle_draft_input_norm
    return h                                    # no final norm

Rotary positions run 0..n-1 over the draft's own sequence of pairs; the draft keeps its own
KV cache (a second cache manager in the fused model, reset and compiled with the target's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from nxdplug.contrib_models.llama.modeling_llama import NeuronLlamaDecoderLayer
from nxdplug.plugin_api import (
    CacheLayout,
    CacheSlot,
    ColumnParallelLinear,
    KVCacheManager,
    ParallelEmbedding,
    RotaryEmbedding,
    StepInputs,
    attention_mask_4d,
    head_dim_of,
    rope_parameters,
)

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, PipelineContext


class EagleDraftModel(nn.Module):
    """Embedding, ``fc``, decoder layers (the first without input norm by default), LM head.

    ``config`` is the draft's InferenceConfig (``fused_spec_config.draft_config``); the
    target's pipeline ``context`` gives the cache (its strategy; rows and length are the
    target's, so that one ``seq_ids`` / position addresses both caches) and
    ``enable_eagle_draft_input_norm``.
    """

    def __init__(self, config: InferenceConfig, context: PipelineContext) -> None:
        super().__init__()
        target_config = context.config
        hidden = config.hidden_size
        self.embed_tokens = ParallelEmbedding(config.vocab_size, hidden)
        self.fc = nn.Linear(2 * hidden, hidden, bias=bool(getattr(config, "bias", True)))
        self.layers = nn.ModuleList(
            NeuronLlamaDecoderLayer(config, index) for index in range(config.num_hidden_layers)
        )
        if not target_config.neuron_config.enable_eagle_draft_input_norm:
            self.layers[0].input_layernorm = nn.Identity()
        self.lm_head = ColumnParallelLinear(hidden, config.vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), rope_parameters(config))
        self.kv_mgr = draft_cache(context, len(self.layers), self.layers[0].self_attn)
        self.feature_size = hidden

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
        rotary_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predicted features [batch, seq, hidden] for the pairs ``(input_ids, features)``.

        ``input_ids`` [batch, seq] are the tokens x_{t+1}, ``features`` [batch, seq, hidden]
        the features f_t, ``position_ids`` [batch, seq] the cache slots the pairs' keys and
        values are written to, ``attention_mask`` [batch, keys] the valid cache positions; a
        pair sees the cached pairs at positions up to its own and sits at rotary position t =
        its slot. A token tree's nodes pass their own ``tree_mask`` [batch, seq, keys] (what
        each node sees) and ``rotary_positions`` (their depth after the prefix) instead.
        """
        x = self.embed_tokens(input_ids)
        x = self.fc(torch.cat((x, features.to(x.dtype)), dim=-1))
        rope, mask = pair_attention(
            self.rotary_emb, attention_mask, position_ids, tree_mask, rotary_positions
        )
        length = attention_mask.shape[-1]
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, mask, CacheSlot(self.kv_mgr, index, position_ids, seq_ids, length))
        return x

    def token_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores of the next token over the vocabulary (float32): the LM head, no norm."""
        return self.lm_head(hidden).float()

    def target_features(
        self,
        model: nn.Module,
        step: StepInputs,
        masks: dict[int | None, torch.Tensor] | None = None,
        rotary_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's final norm output, which is both its LM head's input and the feature
        EAGLE-1 reads."""
        final = model.hidden_states(step, masks, rotary_positions)
        return final, final


def pair_attention(
    rotary_emb: nn.Module,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    tree_mask: torch.Tensor | None,
    rotary_positions: torch.Tensor | None,
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The rotary tables and [batch, 1, pairs, keys] mask of a draft step: each pair sees the
    valid slots up to its own, at the rotary position of its slot; or a tree's own mask and
    rotary positions."""
    rope = rotary_emb(position_ids if rotary_positions is None else rotary_positions)
    if tree_mask is None:
        return rope, attention_mask_4d(attention_mask, position_ids, None)
    return rope, tree_mask[:, None].bool()


def feature_size(config: InferenceConfig) -> int:
    """The width of the target feature the draft reads: the hidden size (EAGLE-1), or three
    layers' (EAGLE-3)."""
    return config.hidden_size * (3 if config.neuron_config.is_eagle3 else 1)


def draft_cache(context: PipelineContext, num_layers: int, attention: nn.Module) -> KVCacheManager:
    """The draft's own KV cache, in the target's cache strategy, rows and length (so that one
    ``seq_ids`` / position addresses both caches)."""
    target = context.config.neuron_config
    layout = CacheLayout(
        num_layers=num_layers,
        max_batch_size=target.max_batch_size,
        num_kv_heads=attention.num_kv_heads,
        max_length=target.seq_len,
        head_dim=attention.head_dim,
        dtype=target.torch_dtype,
    )
    return context.kv_cache(layout)


def add_draft(model: nn.Module, context: PipelineContext) -> None:
    """The ``transform_model`` callback: the target gets its draft as ``eagle_draft`` (EAGLE-3's
    when ``is_eagle3``)."""
    draft_config = context.config.fused_spec_config.draft_config
    if context.config.neuron_config.is_eagle3:
        from nxdplug.plugins.eagle.draft3 import Eagle3DraftModel

        model.eagle_draft = Eagle3DraftModel(draft_config, context)
    else:
        model.eagle_draft = EagleDraftModel(draft_config, context)
