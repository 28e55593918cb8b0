"""Chunked prefill's settings (``NeuronConfig.chunked_prefill_config``), as NxD Inference names
them; setting it switches chunked prefill on (``is_chunked_prefill``)."""

from __future__ import annotations

import attrs


@attrs.define(kw_only=True)
class ChunkedPrefillConfig:
    """``max_num_seqs``: the most prompts one chunked step encodes together (the rows of the
    extension phases' graphs); ``tkg_model_enabled``: decoding keeps the token-generation
    graph (True, the only choice here: it decodes faster than a chunk graph with one real
    token a row). ``kernel_q_tile_size`` and ``kernel_kv_tile_size`` tile NxD Inference's
    Neuron attention kernel: kept in the config, the results do not depend on them."""

    max_num_seqs: int = 8
    kernel_q_tile_size: int = 128
    kernel_kv_tile_size: int = 1024
    tkg_model_enabled: bool = True
