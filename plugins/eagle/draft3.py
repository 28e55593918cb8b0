"""The EAGLE-3 draft model (SafeAILab/EAGLE ``traineagle3``, vLLM's and ``speculators``'
``LlamaForCausalLMEagle3`` checkpoints).

EAGLE-3 reads the target at three depths rather than at its last layer: the inputs of target
layers 2, L//2 and L-3 (a low, a middle and a high feature, concatenated, 3h wide), or of the
three layers the draft's config names in ``eagle_aux_hidden_state_layer_ids`` (vLLM's and
``speculators``' key; id j is the input of layer j, 0 the embedding). One draft
step at draft position t takes the token x_{t+1} and a feature g_t:

    g = fc(g_t)          if g_t is the target's 3h-wide feature (no bias)
        g_t              if it is the draft's own output at t (the later steps of a chain)
    x = cat(input_layernorm(embed(x_{t+1})), hidden_norm(g))    # 2h wide
    h = g + attn(x)                                              # q/k/v read 2h
    h = h + mlp(post_attention_layernorm(h))
    return h                        # the next step's feature; lm_head(norm(h)) scores x_{t+2}

The LM head covers the draft's own vocabulary (``draft_vocab_size``); ``d2t[i]`` is the offset
from draft id i to its target id (``target = i + d2t[i]``). Rotary positions and the cache are
as for EAGLE-1 (:mod:`nxdplug.plugins.eagle.draft`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from nxdplug.plugin_api import (
    CacheSlot,
    ColumnParallelLinear,
    GatedMLP,
    NeuronAttentionBase,
    ParallelEmbedding,
    RMSNorm,
    RotaryEmbedding,
    StepInputs,
    head_dim_of,
    rope_parameters,
)
from nxdplug.plugins.eagle.draft import draft_cache, pair_attention

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, PipelineContext


AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"


def feature_layers(num_layers: int, draft: InferenceConfig | None = None) -> tuple[int, ...]:
    """The target layers whose inputs EAGLE-3 reads: those the draft's config names, else
    2, L//2 and L-3 (as its authors, vLLM and NxD Inference)."""
    chosen = getattr(draft, AUX_LAYERS_KEY, None) if draft is not None else None
    if chosen:
        return tuple(chosen)
    return 2, num_layers // 2, num_layers - 3


class Eagle3Layer(nn.Module):
    """The draft's one decoder layer (``midlayer``): attention over the token's embedding and
    the feature side by side, the feature as the residual."""

    def __init__(self, config: InferenceConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = NeuronAttentionBase(config, 0, input_size=2 * hidden)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.hidden_norm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)

    def forward(
        self,
        embeds: torch.Tensor,
        feature: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: CacheSlot,
    ) -> torch.Tensor:
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(feature)), dim=-1)
        h = feature + self.self_attn(x, rope, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3DraftModel(nn.Module):
    """Embedding, ``fc`` (3h -> h), ``midlayer``, ``norm``, draft-vocabulary LM head, ``d2t``.

    ``config`` is the draft's InferenceConfig; the target's pipeline ``context`` gives the
    cache and the target's layer count (which layers' inputs are read).
    """

    def __init__(self, config: InferenceConfig, context: PipelineContext) -> None:
        super().__init__()
        target_config = context.config
        hidden = config.hidden_size
        target_hidden = getattr(config, "target_hidden_size", None) or target_config.hidden_size
        draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.embed_tokens = ParallelEmbedding(config.vocab_size, hidden)
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=bool(getattr(config, "fc_bias", False)))
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = ColumnParallelLinear(hidden, draft_vocab, bias=False)
        # A weight, not a buffer: compiled graphs take weights as inputs but bake buffers in.
        self.d2t = nn.Parameter(torch.zeros(draft_vocab, dtype=torch.long), requires_grad=False)
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), rope_parameters(config))
        self.target_vocab = target_config.vocab_size
        self.layers_read = feature_layers(target_config.num_hidden_layers, config)
        self.feature_size = 3 * target_hidden
        self.kv_mgr = draft_cache(context, 1, self.midlayer.self_attn)

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
        """The draft's features [batch, seq, hidden] for the pairs ``(input_ids, features)``:
        ``features`` are the target's (3h wide) or the draft's own (h wide); the arguments
        are :class:`~nxdplug.plugins.eagle.draft.EagleDraftModel`'s."""
        feature = self.fc(features) if features.shape[-1] == self.feature_size else features
        embeds = self.embed_tokens(input_ids).to(feature.dtype)
        rope, mask = pair_attention(
            self.rotary_emb, attention_mask, position_ids, tree_mask, rotary_positions
        )
        length = attention_mask.shape[-1]
        cache = CacheSlot(self.kv_mgr, 0, position_ids, seq_ids, length)
        return self.midlayer(embeds, feature, rope, mask, cache)

    def token_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores over the target's vocabulary (float32): the draft vocabulary's logits at
        their target ids, -inf elsewhere (a draft never proposes a token outside it)."""
        logits = self.lm_head(self.norm(hidden)).float()
        ids = torch.arange(logits.shape[-1], device=logits.device) + self.d2t
        full = logits.new_full((*logits.shape[:-1], self.target_vocab), float("-inf"))
        return full.index_copy(-1, ids, logits)

    def target_features(
        self,
        model: nn.Module,
        step: StepInputs,
        masks: dict[int | None, torch.Tensor] | None = None,
        rotary_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's final norm output (for its LM head) and the 3h-wide feature of each
        token: the inputs of the layers EAGLE-3 reads."""
        inputs: list[torch.Tensor] = []
        final = model.hidden_states(step, masks, rotary_positions, layer_inputs=inputs)
        return final, torch.cat([inputs[i] for i in self.layers_read], dim=-1)


def eagle3_draft_problems(config: InferenceConfig, draft: InferenceConfig) -> list[str]:
    """What an EAGLE-3 draft config must say, beside EAGLE-1's checks."""
    problems = []
    if getattr(draft, "num_hidden_layers", 1) != 1:
        problems.append(
            f"the EAGLE-3 draft has num_hidden_layers={draft.num_hidden_layers}; EAGLE-3 drafts "
            "have one layer (midlayer)"
        )
    draft_vocab = getattr(draft, "draft_vocab_size", None) or draft.vocab_size
    if draft_vocab > config.vocab_size:
        problems.append(
            f"the EAGLE-3 draft's draft_vocab_size {draft_vocab} exceeds the target's "
            f"vocab_size {config.vocab_size}"
        )
    target_hidden = getattr(draft, "target_hidden_size", None)
    if target_hidden not in (None, config.hidden_size):
        problems.append(
            f"the EAGLE-3 draft's target_hidden_size is {target_hidden} but the target's "
            f"hidden_size is {config.hidden_size}"
        )
    layers = config.num_hidden_layers
    chosen = getattr(draft, AUX_LAYERS_KEY, None)
    if chosen is None and layers < 4:
        problems.append(
            f"EAGLE-3 reads target layers {feature_layers(layers)}; the target has only "
            f"{layers} layers (name the layers to read in the draft config's {AUX_LAYERS_KEY})"
        )
    elif chosen is not None and (
        not isinstance(chosen, (list, tuple))
        or len(chosen) != 3
        or not all(type(i) is int and 0 <= i < layers for i in chosen)
    ):
        problems.append(
            f"the EAGLE-3 draft's {AUX_LAYERS_KEY} is {chosen!r}; expected three layer ids "
            f"from 0 to {layers - 1} (id j reads the input of target layer j), as its fc "
            "reads three target features"
        )
    if config.neuron_config.sequence_parallel_enabled:
        problems.append("EAGLE-3 with sequence_parallel_enabled is not implemented")
    return problems
