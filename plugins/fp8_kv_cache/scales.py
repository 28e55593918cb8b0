"""The scales of an fp8 KV cache as a config holds them, checked against the model's shape.

Scales live in NeuronConfig (``kv_cache_scales``), so they are saved in ``neuron_config.json``
with a compiled model and are part of its hash. Their JSON form is ``{"k": [...], "v": [...]}``
with one entry per layer: a number (``per_tensor``) or a list of one number per K/V head
(``per_head``). A value is stored as ``saturate(x / scale)`` in float8_e4m3fn and read back as
``fp8 * scale``; ``None`` means scale 1 everywhere (a plain saturating cast).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nxdplug.plugin_api import PipelineContext

SCALES = "kv_cache_scales"
GRANULARITY = "kv_cache_scale_granularity"
GRANULARITIES = ("per_tensor", "per_head")
DEFAULT_GRANULARITY = "per_tensor"
TENSORS = ("k", "v")


def _is_positive_number(value: Any) -> bool:
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    return is_number and math.isfinite(value) and value > 0


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str)


def _entry_problems(name: str, entry: Any, granularity: str, num_heads: int) -> Iterator[str]:
    if granularity == "per_tensor":
        if _is_list(entry):
            yield f"{name} is a list; per-head scales need {GRANULARITY}='per_head'"
        elif not _is_positive_number(entry):
            yield f"{name} is {entry!r}; per_tensor scales are positive finite numbers"
        return
    if not _is_list(entry) or len(entry) != num_heads:
        yield (
            f"{name} is {entry!r}; per_head scales are a list of {num_heads} numbers, one per "
            "K/V head"
        )
        return
    bad = [value for value in entry if not _is_positive_number(value)]
    if bad:
        yield f"{name} holds {bad!r}; scales must be positive finite numbers"


def scale_problems(scales: Any, granularity: Any, num_layers: int, num_heads: int) -> list[str]:
    """What is wrong with ``scales`` for a model of ``num_layers`` x ``num_heads`` K/V heads."""
    if granularity not in GRANULARITIES:
        return [
            f"{GRANULARITY}={granularity!r} is not one of {list(GRANULARITIES)}; per_tensor "
            "gives one scale per layer for K and for V, per_head one per K/V head"
        ]
    if scales is None:
        return []
    what = (
        f"{num_layers} numbers"
        if granularity == "per_tensor"
        else f"{num_layers} lists of {num_heads} numbers"
    )
    fix = (
        f'give {{"k": [...], "v": [...]}} with {what} each (calibrate_kv_cache_scales computes '
        "them), or unset it for scale 1"
    )
    if not isinstance(scales, dict) or set(scales) != set(TENSORS):
        return [f"{SCALES} must be a dict with keys 'k' and 'v'; {fix}"]
    problems = []
    for tensor in TENSORS:
        per_layer = scales[tensor]
        if not _is_list(per_layer) or len(per_layer) != num_layers:
            found = f"has {len(per_layer)} entries" if _is_list(per_layer) else "is not a list"
            problems.append(
                f"{SCALES}[{tensor!r}] {found} but the model has {num_layers} layers; {fix}"
            )
            continue
        for layer, entry in enumerate(per_layer):
            name = f"{SCALES}[{tensor!r}][{layer}]"
            problems += _entry_problems(name, entry, granularity, num_heads)
    return problems


def validate(context: PipelineContext) -> list[str]:
    """The ``validate`` callback: the scale settings against the model's layers and K/V heads.

    NxD Inference also asks for ``XLA_HANDLE_SPECIAL_SCALAR=1`` with ``kv_cache_quant``; that
    is a Neuron (XLA) runtime setting, so it is not required here on the CPU: checking it
    belongs to the neuron backend plugin.
    """
    from nxdplug.plugin_api import ConfigError, attention_head_counts

    config = context.config
    scales = getattr(config.neuron_config, SCALES, None)
    granularity = getattr(config.neuron_config, GRANULARITY, DEFAULT_GRANULARITY)
    try:
        num_kv_heads = attention_head_counts(config)[1]
    except ConfigError:  # the head counts themselves are wrong: the core rules report that
        return scale_problems(None, granularity, 0, 0)
    return scale_problems(scales, granularity, config.num_hidden_layers, num_kv_heads)
