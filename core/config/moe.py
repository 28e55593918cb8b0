"""Mixture-of-experts settings: MoENeuronConfig and its sub-configs, and the core's checks of
them. Enumerations of NxD (``GLUType``, ``BlockShardStrategy``) are stored by name: ``"glu"``,
``"HI_LO"``. The building blocks that read them are in :mod:`nxdplug.modules.moe`.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import attrs
import torch

from nxdplug.config.classrefs import optional_class
from nxdplug.config.dtypes import to_torch_dtype
from nxdplug.config.neuron_config import NeuronConfig
from nxdplug.config.sections import build_section, section_converter
from nxdplug.errors import ConfigError

if TYPE_CHECKING:
    from nxdplug.config.inference_config import InferenceConfig


@attrs.define(kw_only=True)
class RouterConfig:
    """The expert router's activation (an ACT2FN name) and compute dtype."""

    act_fn: str = "softmax"
    dtype: torch.dtype = attrs.field(default=torch.float32, converter=to_torch_dtype)


@attrs.define(kw_only=True)
class BlockwiseMatmulConfig:
    """How the expert MLPs' blockwise matrix multiplication is split and run.

    ``blockwise_nki_autograd_cls`` is a class (None: the backend's default), written to JSON as a
    ``"module:QualName"`` reference. ``block_sharding_strategy`` is ``"HI_LO"`` or
    ``"PING_PONG"``.
    """

    block_size: int = 512
    use_block_parallel: bool = False
    block_sharding_strategy: str = "HI_LO"
    skip_dma_token: bool = False
    skip_dma_weight: bool = False
    logical_nc_config: int = 1
    blockwise_nki_autograd_cls: Any = attrs.field(default=None, converter=optional_class)
    use_torch_block_wise: bool = False
    parallelize_token_to_block_mapping: bool = True
    optimized_block_to_token_mapping: bool = True
    always_augment_inputs_for_blockwise_matmul: bool = False
    use_shard_on_intermediate_dynamic_while: bool = False
    use_shard_on_block_dynamic_while: bool = False
    num_static_blocks: int | None = None


@attrs.define(kw_only=True)
class HybridShardingConfig:
    """Separate tensor- and expert-parallel degrees for context encoding and token generation."""

    moe_cte_tp_degree: int = 1
    moe_cte_ep_degree: int = 1
    moe_tkg_tp_degree: int = 1
    moe_tkg_ep_degree: int = 1


@attrs.define(kw_only=True)
class RoutedExpertsMLPOpsConfig:
    """The shape and numerics of the routed experts' MLPs; the first six settings are required."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    hidden_act: str
    glu_mlp: bool
    bias: bool = False
    glu_type: str = "glu"
    hidden_act_scaling_factor: float = 1.0
    hidden_act_bias: float = 0.0
    capacity_factor: float | None = None
    use_index_calc_kernel: bool = False
    gate_clamp_upper_limit: float | None = None
    gate_clamp_lower_limit: float | None = None
    up_clamp_upper_limit: float | None = None
    up_clamp_lower_limit: float | None = None
    normalize_top_k_affinities: bool = False
    early_expert_affinity_modulation: bool = False
    input_layer_init_method: Any = None
    output_layer_init_method: Any = None
    enable_spmd_rank: bool = False
    is_prefill: bool | None = None


@attrs.define(kw_only=True)
class MoEFusedTKGConfig:
    """Kernel switches for the fused MoE token-generation path (None: the backend decides)."""

    quantized: bool = False
    moe_fused_kernel_enabled: bool | None = None
    router_topk_kernel_enabled: bool | None = None
    expert_mlp_kernel_enabled: bool | None = None
    shared_mlp_kernel_enabled: bool | None = None


@attrs.define(slots=False, init=False, eq=False, repr=False, kw_only=True)
class MoENeuronConfig(NeuronConfig):
    """NeuronConfig plus the settings of mixture-of-experts models.

    ``router_config``, ``blockwise_matmul_config`` and ``hybrid_sharding_config`` take an
    instance or a dict (``router_config={"act_fn": "sigmoid"}``). As in NxD Inference, the
    router may be given as ``router_act_fn`` / ``router_dtype`` keywords instead, and
    ``disable_normalize_top_k_affinities=True`` means ``normalize_top_k_affinities=False``.
    """

    # General
    moe_tp_degree: int = 1
    moe_ep_degree: int = 1
    hybrid_sharding_config: HybridShardingConfig | None = attrs.field(
        default=None, converter=section_converter(HybridShardingConfig, "hybrid_sharding_config")
    )

    # Router
    router_config: RouterConfig = attrs.field(
        factory=RouterConfig, converter=section_converter(RouterConfig, "router_config")
    )
    return_expert_index: bool = False
    return_router_logits: bool = False

    # Expert MLPs
    blockwise_matmul_config: BlockwiseMatmulConfig = attrs.field(
        factory=BlockwiseMatmulConfig,
        converter=section_converter(BlockwiseMatmulConfig, "blockwise_matmul_config"),
    )
    capacity_factor: float | None = None
    glu_mlp: bool = True
    glu_type: str = "glu"
    hidden_act_scaling_factor: float = 1.0
    hidden_act_bias: float = 0.0
    gate_clamp_upper_limit: float | None = None
    gate_clamp_lower_limit: float | None = None
    up_clamp_upper_limit: float | None = None
    up_clamp_lower_limit: float | None = None
    use_index_calc_kernel: bool = False
    early_expert_affinity_modulation: bool = False
    normalize_top_k_affinities: bool = True

    # Shared experts
    fused_shared_experts: bool = False
    shared_experts_sequence_parallel_enabled: bool = False
    transpose_shared_experts_weights: bool = False

    def __init__(self, **kwargs: Any) -> None:
        router = {
            field: kwargs.pop(keyword)
            for keyword, field in ROUTER_KEYWORDS.items()
            if keyword in kwargs
        }
        if router and kwargs.get("router_config") is not None:
            given = ", ".join(f"router_{name}" for name in router)
            warnings.warn(
                f"router_config and {given} both set the router: router_config wins, as in "
                f"NxD Inference, and {given} is ignored",
                stacklevel=2,
            )
        elif router:
            kwargs["router_config"] = build_section(RouterConfig, router, "router_config")
        if "disable_normalize_top_k_affinities" in kwargs:
            disable = kwargs.pop("disable_normalize_top_k_affinities")
            if "normalize_top_k_affinities" in kwargs:
                raise ConfigError(
                    [
                        "disable_normalize_top_k_affinities and normalize_top_k_affinities "
                        "are one setting; give one of them"
                    ]
                )
            kwargs["normalize_top_k_affinities"] = not disable
        super().__init__(**kwargs)


# NxD Inference's MoENeuronConfig keywords for the router, and the RouterConfig field of each.
ROUTER_KEYWORDS = {"router_act_fn": "act_fn", "router_dtype": "dtype"}


GLU_TYPES = ("glu", "swiglu")
ROUTER_ACTIVATIONS = ("softmax", "sigmoid")


def parallel_degree_problems(neuron_config: MoENeuronConfig) -> list[str]:
    """What is wrong with the MoE parallel degrees, with what to set: the experts are laid out
    over all ``tp_degree`` ranks, ``moe_tp_degree x moe_ep_degree`` of them (both 1: each
    expert split over all ranks)."""
    tp_degree = neuron_config.tp_degree
    tp, ep = neuron_config.moe_tp_degree, neuron_config.moe_ep_degree
    if tp < 1 or ep < 1:
        return [f"moe_tp_degree ({tp}) and moe_ep_degree ({ep}) must be at least 1"]
    if tp * ep in (1, tp_degree):
        return []
    fix = (
        f"e.g. moe_tp_degree={tp_degree // ep} with moe_ep_degree={ep}"
        if tp_degree % ep == 0
        else "moe_ep_degree must divide tp_degree"
    )
    return [
        f"moe_tp_degree ({tp}) x moe_ep_degree ({ep}) must equal tp_degree "
        f"({tp_degree}), the ranks the experts are laid out over: {fix}"
    ]


def routed_mlp_problems(config: InferenceConfig, neuron_config: NeuronConfig) -> list[str]:
    """The core's checks of a MoENeuronConfig (nothing for other NeuronConfigs)."""
    if not isinstance(neuron_config, MoENeuronConfig):
        return []
    problems = parallel_degree_problems(neuron_config)
    if neuron_config.glu_type not in GLU_TYPES:
        problems.append(f"glu_type is {neuron_config.glu_type!r}; expected one of {GLU_TYPES}")
    if neuron_config.router_config.act_fn not in ROUTER_ACTIVATIONS:
        problems.append(
            f"router_config.act_fn is {neuron_config.router_config.act_fn!r}; expected one of "
            f"{ROUTER_ACTIVATIONS}"
        )
    if neuron_config.quantized:
        problems.append(
            "quantized=True: the routed experts have no quantized form yet (their stacked "
            "weights would be quantized per expert matrix and then misread); leave quantized "
            "off for mixture-of-experts models"
        )
    if neuron_config.shared_experts_sequence_parallel_enabled:
        problems.append(
            "shared_experts_sequence_parallel_enabled: shared experts are not split along the "
            "sequence on their own here; sequence_parallel_enabled splits the whole MLP block, "
            "shared experts included: leave it False"
        )
    factor = neuron_config.capacity_factor
    if factor is not None and factor <= 0:
        problems.append(f"capacity_factor must be positive or None; got {factor}")
    return problems
