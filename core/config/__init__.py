"""Configuration objects with the NxD Inference API: NeuronConfig, InferenceConfig and friends."""

from __future__ import annotations

from nxdplug.config.buckets import generate_buckets
from nxdplug.config.chunked_prefill import ChunkedPrefillConfig
from nxdplug.config.dtypes import to_torch_dtype
from nxdplug.config.fused_spec import FusedSpecNeuronConfig
from nxdplug.config.hf import (
    load_pretrained_config,
    pretrained_config_attributes,
    read_model_attributes,
    with_rope_aliases,
)
from nxdplug.config.inference_config import CONFIG_FILE, InferenceConfig
from nxdplug.config.lora import LoraServingConfig
from nxdplug.config.moe import (
    BlockwiseMatmulConfig,
    HybridShardingConfig,
    MoEFusedTKGConfig,
    MoENeuronConfig,
    RoutedExpertsMLPOpsConfig,
    RouterConfig,
)
from nxdplug.config.neuron_config import NeuronConfig
from nxdplug.config.sampling import OnDeviceSamplingConfig
from nxdplug.config.validation import core_config_problems, unknown_attribute_problems

__all__ = [
    "CONFIG_FILE",
    "BlockwiseMatmulConfig",
    "ChunkedPrefillConfig",
    "FusedSpecNeuronConfig",
    "HybridShardingConfig",
    "InferenceConfig",
    "LoraServingConfig",
    "MoEFusedTKGConfig",
    "MoENeuronConfig",
    "NeuronConfig",
    "OnDeviceSamplingConfig",
    "RoutedExpertsMLPOpsConfig",
    "RouterConfig",
    "core_config_problems",
    "generate_buckets",
    "load_pretrained_config",
    "pretrained_config_attributes",
    "read_model_attributes",
    "to_torch_dtype",
    "unknown_attribute_problems",
    "with_rope_aliases",
]
