"""NeuronBaseModel: the decoder every causal LM plugin builds on.

One model serves every phase. A sub-model (context encoding, token generation) is this module
run with that phase's fixed input shapes; nothing inside branches on the data. The inputs:

- ``input_ids`` [batch, seq]: the tokens of this step;
- ``attention_mask`` [batch, keys]: which cache positions 0..keys-1 hold valid tokens once this
  step's tokens are written (its width is the bucket, so it fixes how much cache is read);
  or, for tree speculation, [batch, seq, keys]: which cache positions each token sees;
- ``position_ids`` [batch, seq]: the cache position of each token (where its keys and values
  are written, and, with a 2-D mask, its rotary position);
- ``seq_ids`` [batch]: the cache row of each batch entry;
- with on-device sampling, ``sampling_params`` [batch, 3] and ``sampling_noise``
  [batch, global_topk] (see :mod:`nxdplug.runtime.sampling`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nxdplug.errors import NotSupportedError
from nxdplug.modules.attention import attention_head_counts, attention_mask_4d, head_dim_of
from nxdplug.modules.kv_cache import (
    CacheLayout,
    CacheSlot,
    KVCacheManager,
    kv_cache_managers,
)


def is_context_encoding(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> bool:
    """Whether a step encodes a whole prompt: several tokens that fill the mask's width (a
    speculation step's tokens are fewer than the cache positions they see)."""
    return input_ids.shape[1] > 1 and input_ids.shape[1] == attention_mask.shape[-1]


def last_token_states(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The hidden state of each row's last valid token, [batch, 1, hidden]."""
    last = (attention_mask.sum(dim=-1) - 1).clamp(min=0)
    index = last[:, None, None].expand(-1, 1, hidden.shape[-1])
    return hidden.gather(1, index)


class NeuronBaseModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head, with a KV cache from a plugin."""

    def __init__(self, config: Any, optimize_inference: bool = True) -> None:
        super().__init__()
        self.config = config
        self.neuron_config = config.neuron_config
        self.sequence_dimension = 1
        self.kv_mgr: KVCacheManager | None = None
        # The on-device sampler (an nxdplug.runtime.sampling.OnDeviceSampler), set
        # by the plugin that on_device_sampling_config enables; None returns logits.
        self.sampler: Any = None
        self.setup_attr_for_model(config)
        self.init_model(config)
        if optimize_inference:
            self.init_inference_optimization(config)

    def setup_attr_for_model(self, config: Any) -> None:
        """Attributes the modules read; subclasses may extend."""
        neuron_config = config.neuron_config
        self.on_device_sampling = neuron_config.on_device_sampling_config is not None
        self.tp_degree = neuron_config.tp_degree
        self.hidden_size = config.hidden_size
        self.num_attention_heads, self.num_key_value_heads = attention_head_counts(config)
        self.head_dim = head_dim_of(config)
        self.max_batch_size = neuron_config.max_batch_size
        self.buckets = neuron_config.token_generation_buckets or [neuron_config.seq_len]

    def init_model(self, config: Any) -> None:
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
        )

    @property
    def kv_managers(self) -> list[KVCacheManager]:
        """Every KV cache of the model: its own, and any a plugin added (a fused draft's)."""
        return kv_cache_managers(self)

    def init_inference_optimization(self, config: Any) -> None:
        """The KV cache of the strategy the config selects (``static`` unless a plugin's
        attribute, such as ``kv_cache_quant``, switches another on)."""
        from nxdplug.pipeline import select_plugins

        strategy = select_plugins(config).kv_cache_strategy
        self.kv_mgr = strategy.load("implementation")(self.cache_layout())

    def attention_masks(
        self, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> dict[int | None, torch.Tensor]:
        """One mask per distinct attention window among the layers."""
        windows = {layer.self_attn.sliding_window for layer in self.layers}
        if attention_mask.dim() == 3:
            if windows != {None}:
                raise NotSupportedError(
                    "tree attention masks (Medusa) cannot be combined with sliding windows"
                )
            return {None: attention_mask[:, None].bool()}
        return {w: attention_mask_4d(attention_mask, position_ids, w) for w in windows}

    @staticmethod
    def rotary_positions(attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Each token's rotary position: its cache position, or, under a per-token (tree) mask,
        the number of earlier tokens it sees (its depth in the tree plus the prefix)."""
        if attention_mask.dim() == 3:
            return attention_mask.long().sum(dim=-1) - 1
        return position_ids

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The final norm's output for every input token, [batch, seq, hidden]; writes this
        step's keys and values into the cache."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb(self.rotary_positions(attention_mask, position_ids))
        masks = self.attention_masks(attention_mask, position_ids)
        length = attention_mask.shape[-1]
        for index, layer in enumerate(self.layers):
            cache = CacheSlot(self.kv_mgr, index, position_ids, seq_ids, length)
            x = layer(x, rope, masks[layer.self_attn.sliding_window], cache)
        return self.norm(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor,
        sampling_params: torch.Tensor | None = None,
        sampling_noise: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Logits in float32: for context encoding (the prompt fills the mask's width) those of
        each row's last token, [batch, 1, vocab]; otherwise those of every input token,
        [batch, seq, vocab] (one token for token generation, k+1 to verify k speculated ones).

        With a ``sampler``: a tuple, the sampled tokens [batch, 1] of the last position first,
        then the logits when ``output_logits`` is set.
        """
        x = self.hidden_states(input_ids, attention_mask, position_ids, seq_ids)
        if is_context_encoding(input_ids, attention_mask):
            x = last_token_states(x, attention_mask)
        logits = self.lm_head(x).float()
        if self.sampler is None:
            return logits
        tokens = self.sampler(logits[:, -1], sampling_params, sampling_noise)[:, None]
        return (tokens, logits) if self.neuron_config.output_logits else (tokens,)
