"""The checks every config gets before it is used: each problem, in plain words, all at once.

Each rule is a small function returning the problems it sees; :func:`core_config_problems` runs
them all. These are the core's rules: values, ranges and lengths of NeuronConfig and its
sub-configs. What a feature needs of the rest of a config is that feature plugin's check, and
hardware limits (which ``tp_degree`` a target supports) belong to the chosen compile backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import attrs
import torch

from nxdplug.config.dtypes import dtype_name
from nxdplug.config.head_sharding import determine_sharding_strategy, shardable_head_counts
from nxdplug.config.moe import routed_mlp_problems
from nxdplug.config.neuron_config import CAST_TYPES, NeuronConfig
from nxdplug.config.suggestions import did_you_mean
from nxdplug.errors import ConfigError

if TYPE_CHECKING:
    from nxdplug.config.inference_config import InferenceConfig

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

CHOICES: dict[str, tuple[str, ...]] = {
    "padding_side": ("left", "right"),
    "cast_type": CAST_TYPES,
}
AT_LEAST_ONE = (
    "batch_size",
    "ctx_batch_size",
    "tkg_batch_size",
    "max_batch_size",
    "spec_batch_size",
    "seq_len",
    "max_context_length",
    "max_length",
    "n_active_tokens",
    "n_positions",
    "tp_degree",
    "logical_nc_config",
)
# Settings that default to another one: a bad value equal to its source is reported once, there.
DEFAULTS_FROM = {
    "ctx_batch_size": "batch_size",
    "tkg_batch_size": "batch_size",
    "max_batch_size": "batch_size",
    "spec_batch_size": "batch_size",
    "max_context_length": "seq_len",
    "max_length": "seq_len",
    "n_active_tokens": "seq_len",
    "n_positions": "seq_len",
}
AT_LEAST_ZERO = ("speculation_length", "medusa_speculation_length", "num_medusa_heads")
# bucket list -> the lengths its largest bucket may not exceed (token generation: max_length, as
# NxD Inference asserts, and seq_len, the KV cache's positions)
BUCKET_LIMITS = {
    "context_encoding_buckets": ("max_context_length",),
    "token_generation_buckets": ("max_length", "seq_len"),
}

Rule = Callable[["InferenceConfig", NeuronConfig], Iterable[str]]


def core_config_problems(config: InferenceConfig) -> list[str]:
    """Every problem the core sees in ``config``; an empty list means it is usable."""
    neuron_config = getattr(config, "neuron_config", None)
    if not isinstance(neuron_config, NeuronConfig):
        return [
            f"neuron_config is {type(neuron_config).__name__}, not a NeuronConfig: pass "
            "NeuronConfig(...) as the first argument of the InferenceConfig"
        ]
    return [problem for rule in RULES for problem in rule(config, neuron_config)]


def unknown_attribute_problems(
    neuron_config: NeuronConfig, extra_known: Iterable[str] = ()
) -> list[str]:
    """Attributes set on ``neuron_config`` that neither its class nor ``extra_known`` declares.

    ``extra_known`` holds the settings feature plugins declare. Names starting with ``_`` are
    internal state, not settings, and are not reported.
    """
    known = neuron_config.known_attribute_names() | frozenset(extra_known)
    unknown = sorted(name for name in vars(neuron_config) if name not in known)
    return [
        f"unknown NeuronConfig attribute {name!r}{did_you_mean(name, known)}: no field and no "
        "installed plugin declares it, so it would be ignored; fix the name, remove it, or "
        "install the plugin that provides it"
        for name in unknown
        if not name.startswith("_")
    ]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_or_none(value: Any) -> int | None:
    return value if _is_int(value) else None


def _describe_dtype(value: Any) -> str:
    return dtype_name(value) if isinstance(value, torch.dtype) else repr(value)


def _choices(_: InferenceConfig, nc: NeuronConfig) -> Iterator[str]:
    for name, allowed in CHOICES.items():
        value = getattr(nc, name)
        if value not in allowed:
            listing = ", ".join(repr(choice) for choice in allowed)
            yield f"{name} is {value!r}{did_you_mean(str(value), allowed)}; choose one of {listing}"


def _dtypes(_: InferenceConfig, nc: NeuronConfig) -> Iterator[str]:
    supported = ", ".join(dtype_name(dtype) for dtype in SUPPORTED_DTYPES)
    for name in ("torch_dtype", "rpl_reduce_dtype", "attention_dtype"):
        value = getattr(nc, name)
        if name != "torch_dtype" and value is None:
            continue
        if value not in SUPPORTED_DTYPES:
            yield f"{name} is {_describe_dtype(value)}; use one of {supported}"
    attention = nc.attention_dtype
    if nc.attention_dtype_under_global_cast:
        yield (
            f"attention_dtype ({_describe_dtype(attention)}) differs from torch_dtype "
            f"({_describe_dtype(nc.torch_dtype)}), which needs cast_type='as-declared' so "
            "that parameters keep their own dtypes; set it, or drop attention_dtype"
        )


def _counts(_: InferenceConfig, nc: NeuronConfig) -> Iterator[str]:
    for name in AT_LEAST_ONE:
        value = getattr(nc, name)
        source = DEFAULTS_FROM.get(name)
        if source is not None and value == getattr(nc, source):
            continue
        if not _is_int(value) or value < 1:
            yield f"{name} is {value!r}; it must be a whole number, 1 or more"
    for name in AT_LEAST_ZERO:
        value = getattr(nc, name)
        if not _is_int(value) or value < 0:
            yield f"{name} is {value!r}; it must be a whole number, 0 or more"


def _lengths(_: InferenceConfig, nc: NeuronConfig) -> Iterator[str]:
    context = _int_or_none(nc.max_context_length)
    if context is None:
        return
    for name in ("seq_len", "max_length"):
        limit = _int_or_none(getattr(nc, name))
        if limit is not None and context > limit:
            yield (
                f"max_context_length ({context}) is larger than {name} ({limit}); a prompt "
                f"must fit in the sequence: raise {name} or lower max_context_length"
            )


def _per_sub_model_lengths(_: InferenceConfig, nc: NeuronConfig) -> Iterator[str]:
    """``n_positions`` and ``n_active_tokens`` are what NxD Inference sets on each sub-model's
    copy of the config (the KV-cache positions; the tokens a step feeds); given a value of their
    own, they would say something the sub-models do not do."""
    seq_len = _int_or_none(nc.seq_len)
    if seq_len is None:
        return
    positions = _int_or_none(nc.n_positions)
    if positions is not None and positions != seq_len:
        yield (
            f"n_positions ({positions}) is the number of KV-cache positions, which is seq_len "
            f"({seq_len}); set seq_len instead and leave n_positions unset"
        )
    active = _int_or_none(nc.n_active_tokens)
    if active is not None and active != seq_len:
        yield (
            f"n_active_tokens ({active}) is set per sub-model, as NxD Inference does "
            "(max_context_length for context encoding, the tokens of one step for token "
            "generation); leave it unset and set max_context_length for the longest prompt"
        )


def _tensor_parallel(config: InferenceConfig, nc: NeuronConfig) -> Iterator[str]:
    tp = _int_or_none(nc.tp_degree)
    if tp is None or tp < 1:
        return
    heads = _int_or_none(getattr(config, "num_attention_heads", None))
    kv_heads = _int_or_none(getattr(config, "num_key_value_heads", None)) or heads
    if heads is not None and kv_heads is not None:
        try:
            shardable_head_counts(tp, heads, kv_heads, determine_sharding_strategy(tp, kv_heads))
        except ConfigError as error:
            yield from error.problems
    context = _int_or_none(nc.max_context_length)
    if nc.sequence_parallel_enabled and context is not None and context % tp:
        yield (
            f"sequence_parallel_enabled needs max_context_length ({context}) divisible by "
            f"tp_degree ({tp}); change one of them, or disable sequence parallelism"
        )
    buckets = nc.context_encoding_buckets if nc.enable_bucketing else None
    uneven = [b for b in buckets or () if isinstance(b, int) and b % tp]
    if nc.sequence_parallel_enabled and uneven:
        yield (
            f"sequence_parallel_enabled splits each prompt bucket over tp_degree ({tp}) ranks, "
            f"but context_encoding_buckets {uneven} do not divide by it; give buckets that do"
        )


def _buckets(_: InferenceConfig, nc: NeuronConfig) -> Iterator[str]:
    for name, limit_names in BUCKET_LIMITS.items():
        buckets = getattr(nc, name)
        if buckets is None:
            continue
        if not buckets or not all(_is_int(b) and b >= 1 for b in buckets):
            yield f"{name} is {buckets!r}; give a non-empty list of positive whole numbers"
            continue
        if any(a >= b for a, b in pairwise(buckets)):
            yield (
                f"{name} {buckets} are not in increasing order; sort them and remove repeats: "
                f"{sorted(set(buckets))}"
            )
        for limit_name in limit_names:
            limit = _int_or_none(getattr(nc, limit_name))
            if limit is not None and max(buckets) > limit:
                yield (
                    f"the largest of {name} ({max(buckets)}) exceeds {limit_name} ({limit}); "
                    f"drop it, or raise {limit_name}"
                )
                break


def _sampling(_: InferenceConfig, nc: NeuronConfig) -> Iterator[str]:
    sampling = nc.on_device_sampling_config
    if sampling is None:
        return
    if not _is_number(sampling.top_p) or not 0 < sampling.top_p <= 1:
        yield f"on_device_sampling_config.top_p is {sampling.top_p!r}; it must be in (0, 1]"
    if not _is_number(sampling.temperature) or sampling.temperature <= 0:
        yield (
            f"on_device_sampling_config.temperature is {sampling.temperature!r}; it must be "
            "above 0 (use do_sample=False for greedy decoding)"
        )
    if not _is_int(sampling.global_topk) or sampling.global_topk < 1:
        yield (
            f"on_device_sampling_config.global_topk is {sampling.global_topk!r}; it must be "
            "a whole number, 1 or more"
        )
    known = {field.name for field in attrs.fields(type(sampling))}
    for name in sorted(set(vars(sampling)) - known):
        yield (
            f"on_device_sampling_config.{name} is set, but OnDeviceSamplingConfig has no "
            f"setting {name!r}{did_you_mean(name, known)}, so it would be ignored; fix the "
            "name or remove it"
        )


def _lora_config(_: InferenceConfig, nc: NeuronConfig) -> Iterator[str]:
    lora = nc.lora_config
    if lora is None:
        return
    if not _is_int(lora.max_loras) or lora.max_loras < 1:
        yield f"lora_config.max_loras is {lora.max_loras!r}; it must be a whole number, 1 or more"
    if lora.lora_bias != "none":
        yield (
            f"lora_config.lora_bias is {lora.lora_bias!r}: adapters with bias terms are not "
            "implemented; use 'none' (adapters without biases)"
        )
    if lora.dynamic_multi_lora and not lora.enable_dynamic_multi_lora:
        yield (
            "lora_config sets dynamic_multi_lora=True and enable_dynamic_multi_lora=False; "
            "they are one setting: give one of them"
        )


def _async_mode(_: InferenceConfig, nc: NeuronConfig) -> Iterator[str]:
    """The feature guide's prerequisites of async mode, checked before anything is built."""
    if not nc.async_mode:
        return
    if nc.on_device_sampling_config is None:
        yield (
            "async_mode=True needs on-device sampling (the next step starts from the tokens the "
            "model chose, before the host sees them); set on_device_sampling_config, or "
            "async_mode=False"
        )
    speculating = nc.speculation_length > 0 or nc.is_medusa or nc.enable_eagle_speculation
    if speculating:
        yield (
            "async_mode=True with speculative decoding is not implemented (NxD Inference "
            "allows it with fused speculation only); set async_mode=False to speculate"
        )


def _fused_draft_settings(_: InferenceConfig, nc: NeuronConfig) -> Iterator[str]:
    """NxD Inference's settings of the fused draft (an EAGLE draft's own config, a copy of the
    target's, carries them too): ``is_eagle3`` and the token tree's structure."""
    if nc.is_eagle_draft:
        return
    if nc.is_eagle3 and not nc.enable_eagle_speculation:
        yield (
            "is_eagle3=True says the fused draft is an EAGLE-3 head: set "
            "enable_eagle_speculation=True with that draft, or drop is_eagle3"
        )
    if nc.token_tree_config is None:
        return
    from nxdplug.config.token_tree import TokenTree, TokenTreeError

    try:
        tree = TokenTree(nc.token_tree_config)
    except TokenTreeError as error:
        yield from error.problems
        return
    if not nc.enable_eagle_speculation:
        yield (
            "token_tree_config is drafted by fused speculation, as in NxD Inference: set "
            "enable_eagle_speculation=True with an EAGLE draft, or drop token_tree_config"
        )
    if nc.speculation_length != tree.node_nums:
        yield (
            f"token_tree_config has {tree.node_nums} nodes (the root included), so "
            f"speculation_length must be {tree.node_nums}, as NxD Inference requires; it is "
            f"{nc.speculation_length}"
        )


def _batch_bucketing(_: InferenceConfig, nc: NeuronConfig) -> Iterator[str]:
    if nc.token_generation_batches is not None:
        yield (
            f"token_generation_batches={nc.token_generation_batches} (batch bucketing) is not "
            f"implemented: token generation runs tkg_batch_size={nc.tkg_batch_size} rows; "
            "unset it"
        )


RULES: tuple[Rule, ...] = (
    _choices,
    _batch_bucketing,
    _dtypes,
    _counts,
    _lengths,
    _per_sub_model_lengths,
    _tensor_parallel,
    _buckets,
    _sampling,
    _async_mode,
    _fused_draft_settings,
    _lora_config,
    routed_mlp_problems,
)
