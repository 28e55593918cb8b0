"""NeuronBaseModel: the decoder every causal LM plugin builds on.

One model serves every phase. A sub-model (context encoding, token generation) is this module
run with that phase's fixed input shapes, given one :class:`nxdplug.modules.step.StepInputs`
per step; nothing inside branches on the data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from torch import nn

from nxdplug.contracts import with_defaults
from nxdplug.errors import ConfigError
from nxdplug.modules.attention import attention_head_counts, attention_mask_4d, head_dim_of
from nxdplug.modules.kv_cache import (
    CacheLayout,
    CacheSlot,
    KVCacheManager,
    first_row_of_each_line,
    kv_cache_managers,
)
from nxdplug.modules.parallel_linear import tp_rank, tp_world_size, use_collectives
from nxdplug.modules.sequence_parallel import (
    SequenceShards,
    gather_sequence,
    scatter_sequence,
    split_sequence,
)
from nxdplug.modules.step import StepInputs, current_phase, running
from nxdplug.pipeline import current_context

if TYPE_CHECKING:
    from nxdplug.config import InferenceConfig


def is_context_encoding(step: StepInputs) -> bool:
    """Whether a step encodes a whole prompt: several tokens that fill the mask's width (a
    speculation step's tokens are fewer than the cache positions they see)."""
    tokens = step.input_ids.shape[1]
    return tokens > 1 and tokens == step.attention_mask.shape[-1]


def last_token_states(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The hidden state of each row's last valid token, [batch, 1, hidden]."""
    last = (attention_mask.sum(dim=-1) - 1).clamp(min=0)
    index = last[:, None, None].expand(-1, 1, hidden.shape[-1])
    return hidden.gather(1, index)


class LogitsOutput(nn.Module):
    """What a phase returns by default: the float32 logits. The model's ``output_stage`` is a
    slot: a plugin claims it (:func:`nxdplug.slots.claim_slot`) to return something else from
    the same logits (sampled tokens); a second plugin claiming it is refused."""

    def forward(self, logits: torch.Tensor, step: StepInputs) -> torch.Tensor:
        return logits


class DecoderLayer(Protocol):
    """What the model asks of a model family's decoder layer besides running it."""

    takes_sequence_slice: ClassVar[bool] = False
    """Whether it takes this rank's slice of the sequence (its blocks gather the sequence and
    scatter their output, :mod:`nxdplug.modules.sequence_parallel`); False by default."""


class NeuronBaseModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head, with a KV cache from a plugin."""

    def __init__(self, config: InferenceConfig, optimize_inference: bool = True) -> None:
        super().__init__()
        self.config = config
        self.neuron_config = config.neuron_config
        self.sequence_dimension = 1
        self.kv_mgr: KVCacheManager | None = None
        self.output_stage: nn.Module = LogitsOutput()
        self.setup_attr_for_model(config)
        self.init_model(config)
        self.check_sequence_parallel()
        if optimize_inference:
            self.init_inference_optimization(config)

    def setup_attr_for_model(self, config: InferenceConfig) -> None:
        """Attributes the modules read; subclasses may extend."""
        neuron_config = config.neuron_config
        self.tp_degree = neuron_config.tp_degree
        self.hidden_size = config.hidden_size
        self.num_attention_heads, self.num_key_value_heads = attention_head_counts(config)
        self.head_dim = head_dim_of(config)
        self.max_batch_size = neuron_config.max_batch_size
        self.buckets = neuron_config.token_generation_buckets or [neuron_config.seq_len]

    def init_model(self, config: InferenceConfig) -> None:
        """Create ``embed_tokens``, ``layers``, ``norm``, ``lm_head`` and ``rotary_emb``."""
        raise NotImplementedError(f"{type(self).__name__} must implement init_model(config)")

    def cache_layout(self) -> CacheLayout:
        attention = self.layers[0].self_attn
        return CacheLayout(
            num_layers=len(self.layers),
            max_batch_size=self.neuron_config.max_batch_size,
            num_kv_heads=attention.num_kv_heads,
            max_length=self.neuron_config.seq_len,
            head_dim=attention.head_dim,
            dtype=self.neuron_config.torch_dtype,
            neuron_config=self.neuron_config,
        )

    @property
    def kv_managers(self) -> list[KVCacheManager]:
        """Every KV cache of the model: its own, and any a plugin added (a fused draft's)."""
        return kv_cache_managers(self)

    def init_inference_optimization(self, config: InferenceConfig) -> None:
        """The KV cache of the strategy the config selects (``static`` unless a plugin's
        attribute switches another on)."""
        self.kv_mgr = current_context(config).kv_cache(self.cache_layout())

    def attention_masks(
        self, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> dict[int | None, torch.Tensor]:
        """One [batch, 1, seq, keys] mask per distinct attention window among the layers."""
        windows = {layer.self_attn.sliding_window for layer in self.layers}
        return {w: attention_mask_4d(attention_mask, position_ids, w) for w in windows}

    def hidden_states(
        self,
        step: StepInputs,
        masks: dict[int | None, torch.Tensor] | None = None,
        rotary_positions: torch.Tensor | None = None,
        layer_inputs: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The final norm's output for every input token, [batch, seq, hidden]; writes this
        step's keys and values into the cache.

        A phase that lays its tokens out otherwise (a tree) passes its own ``masks`` (per
        attention window) and ``rotary_positions``; by default they follow the step's
        positions and [batch, keys] mask. ``layer_inputs``, when given, receives each
        layer's input [batch, seq, hidden] in order (a draft that reads inner layers).
        """
        if masks is None:
            masks = self.attention_masks(step.attention_mask, step.position_ids)
        if rotary_positions is None:
            rotary_positions = step.position_ids
        x = self.embed_tokens(step.input_ids)
        rope = self.rotary_emb(rotary_positions)
        with running(step), split_sequence(self.sequence_shards()):
            x = scatter_sequence(x, copy=True)
            for layer, cache in zip(self.layers, self.cache_slots(step), strict=True):
                if layer_inputs is not None:
                    layer_inputs.append(gather_sequence(x))
                x = layer(x, rope, masks[layer.self_attn.sliding_window], cache)
            x = gather_sequence(x)
        return self.norm(x)

    def cache_slots(self, step: StepInputs) -> list[CacheSlot]:
        """Where each layer writes this step's keys and values and reads the cached ones."""
        length = step.attention_mask.shape[-1]
        writer_rows = None
        if self.neuron_config.is_continuous_batching:  # padding rows repeat a running line
            writer_rows = first_row_of_each_line(step.seq_ids)
        return [
            CacheSlot(self.kv_mgr, index, step.position_ids, step.seq_ids, length, writer_rows)
            for index in range(len(self.layers))
        ]

    def check_sequence_parallel(self) -> None:
        """Refuse ``sequence_parallel_enabled`` for a model whose layers do not take this
        rank's slice of the sequence (:attr:`DecoderLayer.takes_sequence_slice`)."""
        if not self.neuron_config.sequence_parallel_enabled:
            return
        others = {
            type(layer).__name__
            for layer in self.layers
            if not with_defaults(layer, DecoderLayer).takes_sequence_slice
        }
        if others:
            raise ConfigError(
                [
                    f"sequence_parallel_enabled: the decoder layers of {type(self).__name__} "
                    f"({', '.join(sorted(others))}) do not split the sequence; set it to False"
                ]
            )

    def sequence_shards(self) -> SequenceShards | None:
        """How this step splits the sequence over the ranks: with ``sequence_parallel_enabled``,
        context encoding over several tensor-parallel ranks; otherwise not at all."""
        tp_degree = self.neuron_config.tp_degree
        if not self.neuron_config.sequence_parallel_enabled or not use_collectives(tp_degree):
            return None
        if not current_phase().is_context_encoding:
            return None
        return SequenceShards(tp_world_size(), tp_rank())

    def forward(self, step: StepInputs) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """What ``output_stage`` makes of the float32 logits: for context encoding (the prompt
        fills the mask's width) those of each row's last token, [batch, 1, vocab]; otherwise
        those of every input token, [batch, seq, vocab] (one token for token generation, k+1
        to verify k speculated ones). By default the logits themselves."""
        x = self.hidden_states(step)
        if is_context_encoding(step):
            x = last_token_states(x, step.attention_mask)
        return self.output_stage(self.lm_head(x).float(), step)
