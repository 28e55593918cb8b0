"""The pre-norm residual decoder layer of Llama-style models."""

from __future__ import annotations

import torch
from torch import nn

from nxdplug.modules.kv_cache import CacheSlot


class PreNormDecoderLayer(nn.Module):
    """x + attention(norm(x)), then h + mlp(norm(h)).

    A model's layer class builds ``self_attn``, ``mlp``, ``input_layernorm`` and
    ``post_attention_layernorm`` (the names of HF checkpoints) and inherits this forward. An MLP
    returning a tuple (an MoE block asked for its router logits) contributes its first item.
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
        h = x + self.self_attn(self.input_layernorm(x), rope, mask, cache)
        out = self.mlp(self.post_attention_layernorm(h))
        return h + (out[0] if isinstance(out, tuple) else out)
