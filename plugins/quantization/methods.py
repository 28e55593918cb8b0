"""Symmetric 8-bit weight quantization: the math and the ``quantization_methods`` classes.

A weight ``W`` [out, in] becomes ``Q`` (int8, float8_e4m3fn or float8_e5m2) and a float32
``scale`` ([out] per channel, [1] per tensor) with ``W ≈ Q * scale[:, None]``, saved as
``<module>.weight`` and ``<module>.weight_scale``: the layout other tools write too, so their
checkpoints load here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from nxdplug.plugins.quantization.int4 import pack_int4, quantize_int4
from nxdplug.plugins.quantization.targets import SCALE_SUFFIX, is_quantized_module

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, NeuronConfig

QUANTIZED_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "f8e4m3": torch.float8_e4m3fn,
    "f8e5m2": torch.float8_e5m2,
}


def largest_value(dtype: torch.dtype) -> float:
    """The magnitude the largest weight maps to: 127 for int8 (symmetric, so -128 goes
    unused), the largest finite value for the 8-bit floats (448, 57344)."""
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    return float(info.max)


def quantize_weight(
    weight: torch.Tensor, dtype: torch.dtype, per_channel: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(quantized, scale)`` of a [out, in] weight: each row's (or the whole tensor's) largest
    magnitude maps to :func:`largest_value`; integers are rounded to nearest, floats are
    rounded by the cast. An all-zero row gets scale 1."""
    weight = weight.float()
    magnitude = weight.abs()
    amax = magnitude.amax(dim=1) if per_channel else magnitude.amax().reshape(1)
    limit = largest_value(dtype)
    scale = torch.where(amax > 0, amax / limit, torch.ones_like(amax))
    scaled = weight / scale[:, None]
    if not dtype.is_floating_point:
        scaled = scaled.round()
    # Clamp before the cast: float8_e4m3fn turns anything past 448 into NaN.
    return scaled.clamp(-limit, limit).to(dtype), scale


def dequantize_weight(
    quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``quantized * scale`` per row, in ``dtype``: the float32 product (the float weight the
    quantized one stands for) cast to ``dtype``, as a float32 checkpoint's weights are cast."""
    return (quantized.float() * scale.float()[:, None]).to(dtype)


class SymmetricQuantizer:
    """Quantizes every projection weight of an HF state dict (see
    :mod:`nxdplug.plugins.quantization.targets`), adding a ``weight_scale`` beside each.

    Subclasses fix the 8-bit dtype and the granularity; the registered records point at them.
    """

    dtype_name: ClassVar[str]
    per_channel: ClassVar[bool]

    def quantize_state_dict(
        self, state_dict: dict[str, torch.Tensor], config: InferenceConfig
    ) -> dict[str, torch.Tensor]:
        dtype = QUANTIZED_DTYPES[self.dtype_name]
        skip = config.neuron_config.modules_to_not_convert
        quantized: dict[str, torch.Tensor] = {}
        for key, tensor in _with_untied_head(state_dict, config, skip).items():
            module, _, leaf = key.rpartition(".")
            if leaf == "weight" and tensor.dim() == 2 and is_quantized_module(module, skip):
                quantized[key], quantized[f"{key}{SCALE_SUFFIX}"] = quantize_weight(
                    tensor, dtype, self.per_channel
                )
            else:
                quantized[key] = tensor
        return quantized


def _with_untied_head(
    state_dict: dict[str, torch.Tensor], config: InferenceConfig, skip: list[str] | None
) -> dict[str, torch.Tensor]:
    """With tied embeddings, an explicit ``lm_head.weight``, so that the head can be quantized
    while the embedding table stays in full precision."""
    if (
        "lm_head.weight" in state_dict
        or not getattr(config, "tie_word_embeddings", False)
        or not is_quantized_module("lm_head", skip)
    ):
        return state_dict
    embedding = next((t for k, t in state_dict.items() if k.endswith("embed_tokens.weight")), None)
    if embedding is None:
        return state_dict
    return {**state_dict, "lm_head.weight": embedding}


# Input features per scale of blockwise int4 when quantization_block_size is not set (GPTQ's
# and llm-compressor's usual group size).
DEFAULT_INT4_BLOCK_SIZE = 128


def int4_group(neuron_config: NeuronConfig, in_features: int) -> int:
    """Input features per int4 scale: the row for per_channel_symmetric, else
    ``quantization_block_size``."""
    if neuron_config.quantization_type == "per_channel_symmetric":
        return in_features
    return getattr(neuron_config, "quantization_block_size", None) or DEFAULT_INT4_BLOCK_SIZE


# The setting that says the int4 weights are asymmetric: each layer holds an int8 zero point
# per group beside its scales, ``W = (Q - zero_point) * scale`` (GPTQ ``sym: false``, AWQ
# ``zero_point: true``, compressed-tensors ``symmetric: false``; the checkpoint readers set it).
# Unset (or False), the weights are symmetric and the layers hold no zero points. Known before
# the weights are read, as the layers' parameters and the compiled graphs' inputs depend on it.
ZERO_POINTS_SETTING = "quantization_zero_points"


def int4_zero_points(neuron_config: NeuronConfig) -> bool:
    """Whether the int4 layers hold zero points (``quantization_zero_points``)."""
    return bool(getattr(neuron_config, ZERO_POINTS_SETTING, None))


class Int4Quantizer:
    """Round-to-nearest symmetric int4 of every projection weight of an HF state dict, in
    groups of input features (:func:`int4_group`): ``<module>.weight`` packed as
    compressed-tensors packs it (int32 [out, in / 8], :mod:`.int4`) and ``weight_scale``
    float32 [out, in / group]."""

    def quantize_state_dict(
        self, state_dict: dict[str, torch.Tensor], config: InferenceConfig
    ) -> dict[str, torch.Tensor]:
        neuron_config = config.neuron_config
        skip = neuron_config.modules_to_not_convert
        quantized: dict[str, torch.Tensor] = {}
        for key, tensor in _with_untied_head(state_dict, config, skip).items():
            module, _, leaf = key.rpartition(".")
            if leaf == "weight" and tensor.dim() == 2 and is_quantized_module(module, skip):
                q, scale = quantize_int4(tensor, int4_group(neuron_config, tensor.shape[1]))
                quantized[key], quantized[f"{key}{SCALE_SUFFIX}"] = pack_int4(q), scale
            else:
                quantized[key] = tensor
        return quantized


class Int8PerTensor(SymmetricQuantizer):
    dtype_name = "int8"
    per_channel = False


class Int8PerChannel(SymmetricQuantizer):
    dtype_name = "int8"
    per_channel = True


class F8e4m3PerTensor(SymmetricQuantizer):
    dtype_name = "f8e4m3"
    per_channel = False


class F8e4m3PerChannel(SymmetricQuantizer):
    dtype_name = "f8e4m3"
    per_channel = True


class F8e5m2PerTensor(SymmetricQuantizer):
    dtype_name = "f8e5m2"
    per_channel = False


class F8e5m2PerChannel(SymmetricQuantizer):
    dtype_name = "f8e5m2"
    per_channel = True
