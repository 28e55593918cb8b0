"""Automatic bucket sizes for the context-encoding and token-generation sub-models.

The buckets are NxD Inference's (``modules.autobucketing``): powers of two from the power of two
at or below the minimum, stopping before the one nearest the maximum on a log scale, then the
maximum. The ``generate_buckets_for_*`` functions give the buckets of each sub-model from an
:class:`~nxdplug.config.InferenceConfig` for plain causal-LM bucketing (nxdplug has no prefix
caching, chunked prefill or batch bucketing).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nxdplug.config.inference_config import InferenceConfig
    from nxdplug.config.neuron_config import NeuronConfig

DEFAULT_MIN_BUCKET = 128


def generate_buckets(min_length: int, max_length: int) -> list[int]:
    """NxD Inference's buckets from ``min_length`` to ``max_length``, as a sorted list.

    ``2**k`` for ``k`` from ``floor(log2(min_length))`` up to, but excluding,
    ``round(log2(max_length))``, followed by ``max_length``. Rounding the upper exponent keeps a
    power of two just below the maximum out: ``generate_buckets(128, 1000)`` is
    ``[128, 256, 512, 1000]`` but ``generate_buckets(128, 700)`` is ``[128, 256, 700]``. When
    ``min_length == max_length``, or the maximum is not above the minimum's power of two, the
    only bucket is ``max_length``.
    """
    if min_length < 1 or max_length < 1:
        raise ValueError(
            f"bucket lengths must be positive; got min_length={min_length}, max_length={max_length}"
        )
    if min_length == max_length:
        return [max_length]
    low = int(math.log2(min_length))
    high = round(math.log2(max_length))
    return [1 << exponent for exponent in range(low, high)] + [max_length]


def _neuron_config(config: InferenceConfig | NeuronConfig) -> NeuronConfig:
    """The NeuronConfig of an InferenceConfig (a NeuronConfig is taken as it is)."""
    return getattr(config, "neuron_config", config)


def _sub_model_buckets(
    neuron_config: NeuronConfig, given: list[int] | None, maximum: int
) -> list[int]:
    if not neuron_config.enable_bucketing:
        return generate_buckets(maximum, maximum)
    if given is not None:
        return list(given)
    return generate_buckets(DEFAULT_MIN_BUCKET, maximum)


def generate_buckets_for_cte(inference_config: InferenceConfig | NeuronConfig) -> list[int]:
    """Context-encoding buckets: ``context_encoding_buckets`` when given, else
    ``generate_buckets(128, max_context_length)``; ``[max_context_length]`` without bucketing."""
    neuron_config = _neuron_config(inference_config)
    return _sub_model_buckets(
        neuron_config, neuron_config.context_encoding_buckets, neuron_config.max_context_length
    )


def generate_buckets_for_tkg(
    inference_config: InferenceConfig | NeuronConfig,
) -> list[int] | list[list[int]]:
    """Token-generation buckets: ``token_generation_buckets`` when given, else
    ``generate_buckets(128, max_length)``; ``[max_length]`` without bucketing. With
    ``token_generation_batches`` (NxD Inference's batch bucketing), ``[batch, seq]`` pairs:
    each batch size (tkg_batch_size included), largest first, with each sequence bucket."""
    neuron_config = _neuron_config(inference_config)
    buckets = _token_generation_lengths(neuron_config)
    batches = neuron_config.token_generation_batches
    if batches is None:
        return buckets
    sizes = sorted({*batches, neuron_config.tkg_batch_size}, reverse=True)
    return [[size, bucket] for size in sizes for bucket in buckets]


def _token_generation_lengths(neuron_config: NeuronConfig) -> list[int]:
    return _sub_model_buckets(
        neuron_config, neuron_config.token_generation_buckets, neuron_config.max_length
    )


def generate_buckets_for_speculation(inference_config: InferenceConfig | NeuronConfig) -> list[int]:
    """Buckets of the (non-fused) speculation sub-model: the token-generation lengths."""
    return _token_generation_lengths(_neuron_config(inference_config))


def generate_buckets_for_fused_spec(inference_config: InferenceConfig | NeuronConfig) -> list[int]:
    """Buckets of the fused-speculation sub-model: the token-generation lengths."""
    return _token_generation_lengths(_neuron_config(inference_config))
