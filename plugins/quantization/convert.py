"""The converter step for quantized checkpoints: scales in the layers' layout, dtypes checked.

It runs after the layout steps (GQA replication, QKV fusion), which carry each
``weight_scale`` along with its weight.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from nxdplug.plugin_api import CheckpointError
from nxdplug.plugins.quantization.int4 import (
    PACK_FACTOR,
    float16_rounding,
    kernel_group_size,
    kernel_scales,
    kernel_zero_points,
    padded_features,
    scale_dtype,
    to_kernel_layout,
    unpack_int4,
)
from nxdplug.plugins.quantization.kernel import tile_rows
from nxdplug.plugins.quantization.methods import (
    QUANTIZED_DTYPES,
    ZERO_POINTS_SETTING,
    int4_group,
    int4_zero_points,
)
from nxdplug.plugins.quantization.targets import (
    SCALE_SUFFIX,
    ZERO_POINT_SUFFIX,
    has_row_scales,
    is_quantized_module,
)

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, NeuronConfig

log = logging.getLogger(__name__)


def fit_quantized_weights(
    state_dict: dict[str, torch.Tensor], config: InferenceConfig
) -> dict[str, torch.Tensor]:
    """Reshape scales to the layers' ``[1]`` or ``[out]``, tile int8 weights for the int8
    matmul (:func:`.kernel.tile_rows`) and check every quantized weight.

    Other tools write a per-tensor scale as a scalar and a per-channel one as ``[out, 1]``;
    both are accepted. A projection left in full precision, a weight in another 8-bit dtype or
    a scale of the other granularity is reported, all at once, with the setting that fits.
    """
    neuron_config = config.neuron_config
    if neuron_config.quantization_dtype == "int4":
        return fit_int4_weights(state_dict, config)
    dtype_name = neuron_config.quantization_dtype
    dtype = QUANTIZED_DTYPES[dtype_name]
    granularity = neuron_config.quantization_type
    per_channel = granularity == "per_channel_symmetric"
    fitted = dict(state_dict)
    problems = []
    for key, module, weight, scale in quantized_weights(state_dict, neuron_config):
        if scale is None:
            problems.append(
                f"{key} ({weight.dtype}) has no {key}{SCALE_SUFFIX}: the checkpoint leaves "
                f"{module!r} unquantized; add it to modules_to_not_convert, or quantize the "
                "checkpoint again with save_quantized_state_dict"
            )
            continue
        if weight.dtype != dtype:
            problems.append(
                f"{key} is {weight.dtype}, but quantization_dtype={dtype_name!r} means {dtype}; "
                "set quantization_dtype to the checkpoint's, or quantize it again"
            )
        row_scales = has_row_scales(module, per_channel)
        rows = weight.shape[0] if row_scales else 1
        if row_scales and not per_channel and scale.numel() == 1:
            # A per-tensor scale of a projection the checkpoint already had fused.
            scale = scale.reshape(1).expand(rows)
        if scale.numel() != rows:
            problems.append(
                f"{key}{SCALE_SUFFIX} has {scale.numel()} element(s), but "
                f"quantization_type={granularity!r} means {rows} for this weight; set "
                "quantization_type to the checkpoint's granularity"
            )
        fitted[f"{key}{SCALE_SUFFIX}"] = scale.reshape(-1)
        if weight.dtype == torch.int8 and weight.dim() == 2:
            fitted[key] = tile_rows(weight)
    refuse_misfits(problems, neuron_config)
    return fitted


def quantized_weights(
    state_dict: dict[str, torch.Tensor], neuron_config: NeuronConfig
) -> Iterator[tuple[str, str, torch.Tensor, torch.Tensor | None]]:
    """``(key, module, weight, scale or None)`` of each weight a quantized module holds."""
    skip = neuron_config.modules_to_not_convert
    for key, weight in state_dict.items():
        module, _, leaf = key.rpartition(".")
        if leaf == "weight" and is_quantized_module(module, skip):
            yield key, module, weight, state_dict.get(f"{key}{SCALE_SUFFIX}")


def refuse_misfits(problems: list[str], neuron_config: NeuronConfig) -> None:
    if problems:
        raise CheckpointError(
            f"the quantized checkpoint {neuron_config.quantized_checkpoints_path} does not fit "
            "the config:\n" + "\n".join(f"  {p}" for p in problems)
        )


def fit_int4_weights(
    state_dict: dict[str, torch.Tensor], config: InferenceConfig
) -> dict[str, torch.Tensor]:
    """Packed int4 weights (int32 [out, in / 8]) and their scales ([out, in / group]) to the
    int4 layers' layout (:mod:`.int4`). A checkpoint of another tool may have signed zero
    points beside them (``weight_zero_point`` [out, in / group], as GPTQ and AWQ write
    asymmetric weights). With ``quantization_zero_points`` the layers hold them (zeros where
    the checkpoint has none); without, zero points that are all 0 are dropped and others are
    reported, as the layers hold none. Scales are held in float16 (float32 in a float32 model):
    a scale float16 cannot hold is reported, and rounding other tools' float32 scales is
    logged."""
    neuron_config = config.neuron_config
    held_zero_points = int4_zero_points(neuron_config)
    fitted = dict(state_dict)
    problems = []
    asymmetric: list[str] = []  # zero points other than 0 that the layers would not hold
    rounding = 0.0
    dtype = scale_dtype(neuron_config.torch_dtype)
    for key, _, packed, scale in quantized_weights(state_dict, neuron_config):
        if packed.dtype != torch.int32 or packed.dim() != 2 or scale is None or scale.dim() != 2:
            problems.append(
                f"{key} is {packed.dtype} {list(packed.shape)} with scale "
                f"{None if scale is None else list(scale.shape)}; int4 weights are int32 "
                "[out, in / 8] with a scale [out, in / group]: quantize the checkpoint with "
                "quantization_dtype='int4' (or leave the module in modules_to_not_convert)"
            )
            continue
        in_features = packed.shape[1] * PACK_FACTOR
        group = int4_group(neuron_config, in_features)
        groups = -(-in_features // group)
        if scale.shape != (packed.shape[0], groups):
            problems.append(
                f"{key}{SCALE_SUFFIX} is {list(scale.shape)}, but groups of {group} input "
                f"features mean {[packed.shape[0], groups]}; set "
                "quantization_type / quantization_block_size to the checkpoint's"
            )
            continue
        kernel_group = kernel_group_size(group, in_features)
        padded = padded_features(in_features)
        zero_key = f"{key}{ZERO_POINT_SUFFIX}"
        zero_point = fitted.pop(zero_key, None)
        if zero_point is not None and zero_point.shape != scale.shape:
            problems.append(
                f"{zero_key} is {list(zero_point.shape)}; zero points are one a scale, "
                f"{list(scale.shape)}"
            )
            continue
        if held_zero_points:
            if zero_point is None:
                zero_point = torch.zeros_like(scale, dtype=torch.int8)
            fitted[zero_key] = kernel_zero_points(zero_point, group, kernel_group, padded)
        elif zero_point is not None and zero_point.any():
            asymmetric.append(zero_key)
            continue
        try:
            scales = kernel_scales(scale, group, kernel_group, padded, dtype)
        except ValueError as error:
            problems.append(f"{key}{SCALE_SUFFIX}: {error}; leave the module in full precision")
            continue
        if dtype == torch.float16:
            rounding = max(rounding, float16_rounding(scale))
        fitted[key] = to_kernel_layout(unpack_int4(packed), padded)
        fitted[f"{key}{SCALE_SUFFIX}"] = scales
    if asymmetric:
        problems.append(asymmetric_problem(asymmetric))
    refuse_misfits(problems, neuron_config)
    if rounding:
        log.warning(
            "int4 scales of %s rounded to float16, which the int4 kernels hold: a scale moved "
            "by up to %.2g of itself",
            neuron_config.quantized_checkpoints_path,
            rounding,
        )
    return fitted


def asymmetric_problem(zero_point_keys: list[str]) -> str:
    shown = ", ".join(zero_point_keys[:3])
    more = f" and {len(zero_point_keys) - 3} more" if len(zero_point_keys) > 3 else ""
    return (
        f"{shown}{more} hold zero points other than 0 (asymmetric weights), but "
        f"{ZERO_POINTS_SETTING} is not set, so the int4 layers hold none: set "
        f"{ZERO_POINTS_SETTING}=True (another tool's checkpoint: its quantization_config must "
        "say so, GPTQ sym false, AWQ zero_point true, compressed-tensors symmetric false)"
    )
