"""NeuronConfig: the compile-time settings of a model, with NxD Inference's names and defaults.

The fields are one attrs table. Defaults that depend on other settings (``max_context_length``
defaults to ``seq_len``, the batch sizes to ``batch_size``, ...) are factories over the fields
declared before them. As in NxD Inference, the object stays open: attributes can be set after
construction (``copy.deepcopy`` then ``draft.speculation_length = 0``), and a keyword the class
does not declare is kept as a plain attribute; :mod:`nxdplug.config.validation` reports such
names, with a did-you-mean, when the config is used.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import attrs
import torch

from nxdplug.config.buckets import DEFAULT_MIN_BUCKET, generate_buckets
from nxdplug.config.chunked_prefill import ChunkedPrefillConfig
from nxdplug.config.dtypes import optional_torch_dtype, to_torch_dtype
from nxdplug.config.lora import LoraServingConfig
from nxdplug.config.sampling import OnDeviceSamplingConfig
from nxdplug.config.sections import section_converter
from nxdplug.config.serialization import to_jsonable
from nxdplug.config.value_object import ComparedByValue
from nxdplug.errors import ConfigError

LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
DEPRECATED_ALIASES = {"logical_neuron_cores": "logical_nc_config"}


def _computed(compute: Any) -> Any:
    """A default computed as ``compute(config)`` from the fields declared above it."""
    return attrs.Factory(compute, takes_self=True)


# How parameters take their dtypes: all cast to torch_dtype, or each keeps the one declared.
CAST_TYPES = ("config", "as-declared")


def _tree_config(value: Any) -> Any:
    """A token tree given as a JSON file's path is read here (as NxD Inference's demo reads
    ``--token-tree-json``); its structure is checked with the rest of the config."""
    if not isinstance(value, (str, os.PathLike)):
        return value
    try:
        return json.loads(Path(value).read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(
            [
                f"token_tree_config {str(value)!r} is not a readable JSON file ({error}); give "
                'the tree as a dict, e.g. {"0": [1, 2], "1": [3]}, or the path of a JSON file '
                "holding one"
            ]
        ) from None


def _sorted_batches(value: Any) -> list[int] | None:
    if value is None:
        return None
    return sorted(value) if isinstance(value, list | tuple) else [value]


def _optional_list(value: Any) -> Any:
    return None if value is None else list(value)


def _max_new_tokens(config: NeuronConfig) -> int | None:
    if not isinstance(config.seq_len, int) or not isinstance(config.max_context_length, int):
        return None
    return (config.seq_len - config.max_context_length) or None


def _auto_buckets(maximum_of: str) -> Any:
    """Buckets up to the setting ``maximum_of`` when bucketing is on and none were given."""

    def compute(config: NeuronConfig) -> list[int] | None:
        maximum = getattr(config, maximum_of)
        if not config.enable_bucketing or not isinstance(maximum, int) or maximum < 1:
            return None
        return generate_buckets(DEFAULT_MIN_BUCKET, maximum)

    return compute


def _default_lnc() -> int:
    raw = os.environ.get(LNC_ENV)
    if raw is None:
        return 1
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            [f"{LNC_ENV}={raw!r} is not an integer; set it to 1 or 2, or unset it"]
        ) from None


def _layout_skips(config: NeuronConfig) -> list[str]:
    lora = config.lora_config
    return [r".*lora.*"] if lora is not None and lora.enable_dynamic_multi_lora else []


@attrs.define(slots=False, init=False, eq=False, repr=False, kw_only=True)
class NeuronConfig(ComparedByValue):
    """Compile-time settings: shapes, dtypes, parallelism, features. Pass them as keywords."""

    # General
    batch_size: int = 1
    padding_side: str = "right"
    seq_len: int = 128
    max_context_length: int = attrs.field(default=_computed(lambda c: c.seq_len))
    max_new_tokens: int | None = attrs.field(default=_computed(_max_new_tokens))
    max_length: int = attrs.field(default=_computed(lambda c: c.seq_len))
    # Cut a prompt longer than max_context_length (with a warning) instead of refusing it.
    allow_input_truncation: bool = False
    n_active_tokens: int = attrs.field(default=_computed(lambda c: c.seq_len))
    n_positions: int = attrs.field(default=_computed(lambda c: c.seq_len))
    torch_dtype: torch.dtype = attrs.field(default=torch.bfloat16, converter=to_torch_dtype)
    # True when the user chose torch_dtype; otherwise load_pretrained_config applies the
    # checkpoint's dtype (NxD Inference behaves the same way).
    overrides_torch_dtype: bool = False
    rpl_reduce_dtype: torch.dtype | None = attrs.field(default=None, converter=optional_torch_dtype)
    cast_type: str = "config"
    async_mode: bool = False
    save_sharded_checkpoint: bool = True
    logical_nc_config: int = attrs.field(factory=_default_lnc)
    skip_sharding: bool = False
    skip_warmup: bool = False
    scratchpad_page_size: int | None = None
    compile_backend: str | None = None
    # NxD Inference's CPU mode: the model runs on the CPU through to_cpu(); compile() and
    # load(), which make and run a backend's graphs, refuse it.
    on_cpu: bool = False

    # Distributed
    tp_degree: int = 1

    # Attention
    flash_decoding_enabled: bool = False
    fused_qkv: bool = False
    sequence_parallel_enabled: bool = False
    qk_layernorm: bool = False
    attention_dtype: torch.dtype | None = attrs.field(default=None, converter=optional_torch_dtype)

    # On-device sampling
    on_device_sampling_config: OnDeviceSamplingConfig | None = attrs.field(
        default=None,
        converter=section_converter(OnDeviceSamplingConfig, "on_device_sampling_config"),
    )
    output_logits: bool = False

    # Bucketing
    enable_bucketing: bool = False
    context_encoding_buckets: list[int] | None = attrs.field(
        default=_computed(_auto_buckets("max_context_length")), converter=_optional_list
    )
    token_generation_buckets: list[int] | None = attrs.field(
        default=_computed(_auto_buckets("max_length")), converter=_optional_list
    )

    # Quantization
    quantized: bool = False
    quantized_checkpoints_path: str | None = None
    quantization_dtype: str = "int8"
    quantization_type: str = "per_tensor_symmetric"
    modules_to_not_convert: list[str] | None = None
    draft_model_modules_to_not_convert: list[str] | None = None
    kv_cache_quant: bool = False

    # Kernels
    attn_kernel_enabled: bool = False
    qkv_kernel_enabled: bool = False
    mlp_kernel_enabled: bool = False
    quantized_mlp_kernel_enabled: bool = False
    rmsnorm_quantize_kernel_enabled: bool = False

    # Continuous batching
    is_continuous_batching: bool = False
    max_batch_size: int = attrs.field(default=_computed(lambda c: c.batch_size))
    ctx_batch_size: int = attrs.field(default=_computed(lambda c: c.batch_size))
    tkg_batch_size: int = attrs.field(default=_computed(lambda c: c.batch_size))
    # NxD Inference's batch bucketing (token-generation graphs for fewer rows): the buckets
    # functions list them; building a model with them is refused (not implemented).
    token_generation_batches: list[int] | None = attrs.field(
        default=None, converter=_sorted_batches
    )
    chunked_prefill_config: ChunkedPrefillConfig | None = attrs.field(
        default=None,
        converter=section_converter(ChunkedPrefillConfig, "chunked_prefill_config"),
    )

    # Speculative decoding
    speculation_length: int = 0
    spec_batch_size: int = attrs.field(default=_computed(lambda c: c.batch_size))
    trace_tokengen_model: bool = True
    enable_eagle_speculation: bool = False
    enable_eagle_draft_input_norm: bool = False
    enable_fused_speculation: bool = attrs.field(
        default=_computed(lambda c: bool(c.enable_eagle_speculation))
    )
    is_eagle_draft: bool = False
    is_eagle3: bool = False
    # A draft token tree ({node: [children]}), as NxD Inference's token_tree_config.
    token_tree_config: dict[str, list[int]] | None = attrs.field(
        default=None, converter=_tree_config
    )
    enable_token_tree: bool = attrs.field(
        default=_computed(lambda c: c.token_tree_config is not None)
    )

    # Medusa
    is_medusa: bool = False
    medusa_speculation_length: int = 0
    num_medusa_heads: int = 0
    medusa_tree: list[list[int]] | None = None

    # Multi-LoRA serving
    lora_config: LoraServingConfig | None = attrs.field(
        default=None, converter=section_converter(LoraServingConfig, "lora_config")
    )
    weights_to_skip_layout_optimization: list[str] = attrs.field(
        default=_computed(_layout_skips), converter=list
    )

    # Compilation
    cc_pipeline_tiling_factor: int = 2

    def __init__(self, **kwargs: Any) -> None:
        for old, new in DEPRECATED_ALIASES.items():
            if old in kwargs:
                _warn_deprecated(old, new)
                kwargs.setdefault(new, kwargs.pop(old))
        kwargs.setdefault("overrides_torch_dtype", "torch_dtype" in kwargs)
        known = self.known_attribute_names()
        extras = {name: kwargs.pop(name) for name in list(kwargs) if name not in known}
        self.__attrs_init__(**kwargs)
        for name, value in extras.items():
            setattr(self, name, value)
        self._check_at_construction()

    def _check_at_construction(self) -> None:
        """NxD Inference's checks at construction (validation repeats the precision ones at
        build, after attributes may have changed)."""
        batches = self.token_generation_batches
        if batches is not None and batches[-1] > self.tkg_batch_size:
            raise BatchBucketsError(
                [
                    f"Token generation batch buckets {batches} should be <= token generation "
                    f"batch size ({self.tkg_batch_size})"
                ]
            )
        if self.cast_type not in CAST_TYPES:
            raise CastTypeError(
                [f"cast_type must be one of config, as-declared; got {self.cast_type!r}"]
            )
        attention = self.attention_dtype
        if self.attention_dtype_under_global_cast:
            raise AttentionDtypeError(
                [
                    "attention dtype and torch dtype are different, however global cast is "
                    "enabled. To enable running multiple precisions, set cast-type to "
                    f"'as-declared' (attention_dtype {attention}, torch_dtype "
                    f"{self.torch_dtype}: set cast_type='as-declared', or drop attention_dtype)"
                ]
            )

    @property
    def attention_dtype_under_global_cast(self) -> bool:
        """``attention_dtype`` differs from ``torch_dtype``, which the global cast
        (``cast_type="config"``) would override."""
        attention = self.attention_dtype
        return (
            attention is not None
            and attention != self.torch_dtype
            and self.cast_type != "as-declared"
        )

    @classmethod
    def known_attribute_names(cls) -> frozenset[str]:
        """The names this class declares, those of subclasses' extra fields included."""
        return frozenset(field.name for field in attrs.fields(cls))

    @property
    def logical_neuron_cores(self) -> int:
        """Deprecated alias of ``logical_nc_config`` (NxD Inference v0.1)."""
        _warn_deprecated("logical_neuron_cores", "logical_nc_config")
        return self.logical_nc_config

    @logical_neuron_cores.setter
    def logical_neuron_cores(self, value: int) -> None:
        _warn_deprecated("logical_neuron_cores", "logical_nc_config")
        self.logical_nc_config = value

    def apply_checkpoint_dtype(self, dtype: Any) -> None:
        """Use the checkpoint's ``dtype`` unless the user chose ``torch_dtype`` themselves."""
        resolved = to_torch_dtype(dtype)
        if not self.overrides_torch_dtype and isinstance(resolved, torch.dtype):
            self.torch_dtype = resolved

    def to_dict(self) -> dict[str, Any]:
        """Every attribute, JSON-ready: dtypes as names, sub-configs as dicts."""
        return to_jsonable(vars(self), type(self).__name__)


class CastTypeError(ConfigError, ValueError):
    """An unknown ``cast_type``: the ValueError NxD Inference raises."""


class BatchBucketsError(ConfigError, AssertionError):
    """``token_generation_batches`` above ``tkg_batch_size``: NxD Inference's AssertionError."""


class AttentionDtypeError(ConfigError, AssertionError):
    """``attention_dtype`` other than ``torch_dtype`` without ``cast_type='as-declared'``: the
    AssertionError NxD Inference raises."""


def _warn_deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"NeuronConfig.{old} is deprecated; use {new} instead", DeprecationWarning, stacklevel=3
    )
