"""The pre-norm residual decoder layer of Llama-style models."""

from __future__ import annotations

import torch
from torch import nn

from nxdplug.modules.kv_cache import CacheSlot
from nxdplug.modules.sequence_parallel import gather_sequence, scatter_sequence


class PreNormDecoderLayer(nn.Module):
    """x + attention(norm(x)), then h + mlp(norm(h)).

    A model's layer class builds ``self_attn``, ``mlp``, ``input_layernorm`` and
    ``post_attention_layernorm`` (the names of HF checkpoints) and inherits this forward. An MLP
    returning a tuple (an MoE block asked for its router logits) contributes its first item.
    With the sequence split over the ranks (:mod:`nxdplug.modules.sequence_parallel`), ``x`` is
    this rank's slice: the norms and residual adds work on it, and each block gets the gathered
    sequence and gives back this rank's slice of its output.
    """

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: CacheSlot,
    ) -> torch.Tensor:
        attended = self.self_attn(gather_sequence(self.input_layernorm(x)), rope, mask, cache)
        h = x + scatter_sequence(attended)
        out = self.mlp(gather_sequence(self.post_attention_layernorm(h)))
        return h + scatter_sequence(out[0] if isinstance(out, tuple) else out)
