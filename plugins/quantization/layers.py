"""Weight methods that keep a parallel linear layer's weight in 8 or 4 bits (multiplied as it is
by a kernel for a few rows, dequantized for more), and the model transform that gives them to
the full-precision projections.

The quantized ``weight`` and its ``weight_scale`` are parameters (``requires_grad=False``) of
the layer itself, under the checkpoint's own names, so checkpoint loading and the compiled graphs
(which take every parameter as an input) handle them like any other weight. 8-bit scales stay
float32; int4 scales are in the kernel's layout and the model's dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from nxdplug.plugin_api import ConfigError, ShardedLinear, WeightMethod, set_weight_method
from nxdplug.plugins.quantization.int4 import (
    dequantize_int4,
    int4_kernels,
    kernel_group_size,
    kernel_groups,
    padded_features,
    scale_dtype,
)
from nxdplug.plugins.quantization.kernel import int8_matmul_op, tile_rows, untile_rows
from nxdplug.plugins.quantization.methods import (
    QUANTIZED_DTYPES,
    dequantize_weight,
    int4_group,
    int4_zero_points,
)
from nxdplug.plugins.quantization.targets import (
    has_row_scales,
    is_quantized_module,
    names_module,
)

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, PipelineContext

INT8_KERNEL_INPUT_DTYPES = (torch.float32, torch.bfloat16)
INT4_KERNEL_INPUT_DTYPES = (torch.float32, torch.bfloat16)


class QuantizedWeight(WeightMethod):
    """The weight method of the 8-bit layers: the 8-bit ``weight`` ([out, in], int8 tiled for
    the int8 matmul), its float32 ``weight_scale`` ([out] or [1]) and the dequantization. On a
    row-parallel layer the scales are whole on every rank, since each holds all the rows."""

    def __init__(self, dtype: torch.dtype, row_scales: bool) -> None:
        self.dtype = dtype
        self.row_scales = row_scales

    def create_weights(self, layer: ShardedLinear) -> None:
        shape, device = layer.weight.shape, layer.weight.device
        layer.weight = nn.Parameter(
            torch.empty(shape, dtype=self.dtype, device=device), requires_grad=False
        )
        rows = shape[0] if self.row_scales else 1
        if self.dtype == torch.int8:
            # Registers the int8 matmul now: a compiled graph that calls it by name can only
            # be loaded once it is there.
            int8_matmul_op()
        layer.weight_scale = nn.Parameter(
            torch.ones(rows, dtype=torch.float32, device=device), requires_grad=False
        )
        # The scales stay float32 in a bf16 model: rounded to bf16, they moved every output of a
        # row by up to 2**-9.
        layer.keeps_dtype = ("weight_scale",)

    def dense_weight(self, layer: ShardedLinear, dtype: torch.dtype) -> torch.Tensor:
        """The 8-bit weight dequantized for this call."""
        return dequantize_weight(rows(layer.weight), layer.weight_scale, dtype)

    def shard_state_dict(
        self, layer: ShardedLinear, full: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """This rank's shard of the converted (tiled) tensors, tiled again: the rows or
        columns are cut in row order."""
        weight = full.get("weight")
        if weight is None or weight.dtype != torch.int8:
            return layer.shard_weights(full)
        part = layer.shard_weights({**full, "weight": untile_rows(weight)})
        return {**part, "weight": tile_rows(part["weight"])}

    def apply(
        self, layer: ShardedLinear, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """float32 and bfloat16 rows times an int8 weight on the CPU go to the plugin's int8
        matmul (:mod:`.kernel`): a few rows (decoding) are multiplied in integers from the 8-bit
        weight as it is, scaled by each row's float32 scale, reading half the bytes of a bf16
        weight and making no full-precision copy; more rows (prompts) get the weight dequantized
        a panel at a time for a bf16 GEMM. fp8 weights, float16 inputs and other devices
        dequantize the weight here for a GEMM."""
        int8_matmul = (
            int8_matmul_op()
            if layer.weight.dtype == torch.int8
            and x.device.type == "cpu"
            and x.dtype in INT8_KERNEL_INPUT_DTYPES
            else None
        )
        if int8_matmul is None:
            return F.linear(x, self.dense_weight(layer, x.dtype), bias)
        out = int8_matmul(x.reshape(-1, x.shape[-1]), layer.weight, layer.weight_scale)
        out = out.reshape(*x.shape[:-1], -1)
        return out if bias is None else out + bias


def rows(weight: torch.Tensor) -> torch.Tensor:
    """An 8-bit weight [out, in] in row order: int8 weights are held tiled for the int8 matmul
    (:func:`.kernel.tile_rows`, done by the checkpoint converter)."""
    return untile_rows(weight) if weight.dtype == torch.int8 else weight


class Int4Weight(WeightMethod):
    """The weight method of the int4 layers: the weight packed in the int4 kernels' layout
    (uint8 [out, padded in / 2]), its ``weight_scale`` (float16; float32 in a float32 model) and,
    for asymmetric weights only (``zero_points``), int8 ``weight_zero_point`` ([out, groups],
    tiled), and the two ways to multiply (:mod:`.int4`)."""

    def __init__(self, group: int, scale_dtype: torch.dtype, zero_points: bool = False) -> None:
        self.group = group
        self.scale_dtype = scale_dtype
        self.zero_points = zero_points
        # Set by create_weights, from the layer's input features.
        self.kernel_group = 0
        self.multiplied_features = 0

    def create_weights(self, layer: ShardedLinear) -> None:
        out_features, in_features = layer.weight.shape
        # Registers the kernels now: a compiled graph that calls them by name can only be
        # loaded once they are there.
        int4_kernels()
        self.kernel_group = kernel_group_size(self.group, in_features)
        # The layout holds zero columns past the input features the layer multiplies.
        self.multiplied_features = in_features
        padded = padded_features(in_features)
        device = layer.weight.device
        layer.weight = nn.Parameter(
            torch.empty(out_features, padded // 2, dtype=torch.uint8, device=device),
            requires_grad=False,
        )
        groups = (out_features, kernel_groups(self.kernel_group, padded))
        layer.weight_scale = nn.Parameter(
            torch.ones(groups, dtype=self.scale_dtype, device=device), requires_grad=False
        )
        if self.zero_points:
            layer.weight_zero_point = nn.Parameter(
                torch.zeros(groups, dtype=torch.int8, device=device), requires_grad=False
            )
        layer.keeps_dtype = ("weight_scale",)

    def held_zero_points(self, layer: ShardedLinear) -> torch.Tensor | None:
        """The layer's zero points; None for symmetric weights, which hold none."""
        return layer.weight_zero_point if self.zero_points else None

    def dense_weight(self, layer: ShardedLinear, dtype: torch.dtype) -> torch.Tensor:
        """The int4 weight dequantized for this call (prompts on other devices)."""
        return dequantize_int4(
            layer.weight,
            layer.weight_scale,
            self.held_zero_points(layer),
            self.kernel_group,
            self.multiplied_features,
            dtype,
        )

    def apply(
        self, layer: ShardedLinear, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """float32 and bfloat16 rows on the CPU go to the plugin's int4 matmul, which reads
        the packed weight as it is for up to a hundred-odd rows (decoding, a batch's steps,
        short prompts) and dequantizes it for a GEMM beyond (``int4_kernels.cpp`` says where
        each way wins); float16 and other devices dequantize here."""
        rows = x.numel() // x.shape[-1]
        kernels = (
            int4_kernels()
            if x.device.type == "cpu" and x.dtype in INT4_KERNEL_INPUT_DTYPES
            else None
        )
        if kernels is None:
            return F.linear(x, self.dense_weight(layer, x.dtype), bias)
        out = kernels.int4_matmul(
            x.reshape(rows, x.shape[-1]),
            layer.weight,
            layer.weight_scale,
            self.held_zero_points(layer),
            self.kernel_group,
        )
        out = out.reshape(*x.shape[:-1], -1)
        return out if bias is None else out + bias


# The claimant named when another plugin sets a layer's weight method too.
CLAIMANT = "weight-quantization"


def quantize_linear_layers(model: nn.Module, config: InferenceConfig) -> None:
    """Put quantized layers in place of the projections the config quantizes, before the
    weights are loaded.

    An entry of ``modules_to_not_convert`` that names no module of the model is an error: a
    typo would otherwise quantize the module it meant to keep.
    """
    neuron_config = config.neuron_config
    int4 = neuron_config.quantization_dtype == "int4"
    dtype = None if int4 else QUANTIZED_DTYPES[neuron_config.quantization_dtype]
    per_channel = neuron_config.quantization_type == "per_channel_symmetric"
    int4_scales = scale_dtype(neuron_config.torch_dtype)
    zero_points = int4_zero_points(neuron_config)
    skip = neuron_config.modules_to_not_convert
    modules = dict(model.named_modules())
    unknown = [e for e in skip or () if not any(names_module(e, name) for name in modules)]
    if unknown:
        examples = [name for name in modules if is_quantized_module(name, None)][:3]
        raise ConfigError(
            f"modules_to_not_convert entry {entry!r} names no module of "
            f"{type(model).__name__}; give module names such as 'lm_head', "
            f"'layers.0.self_attn' or {', '.join(map(repr, examples))} (without the "
            "checkpoint's 'model.' prefix)"
            for entry in unknown
        )
    for name, module in modules.items():
        if not isinstance(module, ShardedLinear) or not is_quantized_module(name, skip):
            continue
        if int4:
            group = int4_group(neuron_config, module.in_features)
            hold_int4(module, group, int4_scales, zero_points)
        else:
            hold_quantized(module, dtype, has_row_scales(name, per_channel))


def hold_quantized(layer: ShardedLinear, dtype: torch.dtype, row_scales: bool) -> ShardedLinear:
    """``layer`` (a parallel linear) with its weight held in 8 bits, unloaded: an empty 8-bit
    weight and a scale per output row (``row_scales``) or one. The layer keeps its shape,
    sharding and output deltas; only the weight changes."""
    set_weight_method(_parallel_linear(layer), QuantizedWeight(dtype, row_scales), CLAIMANT)
    return layer


def hold_int4(
    layer: ShardedLinear,
    group: int,
    scale_dtype: torch.dtype = torch.float16,
    zero_points: bool = False,
) -> ShardedLinear:
    """``layer`` (a parallel linear) with its weight held in int4, unloaded, with scales in
    ``scale_dtype`` for groups of ``group`` input features and, if ``zero_points``, a zero point
    per group (as :func:`hold_quantized` does for 8 bits)."""
    method = Int4Weight(group, scale_dtype, zero_points)
    set_weight_method(_parallel_linear(layer), method, CLAIMANT)
    return layer


def _parallel_linear(layer: nn.Module) -> ShardedLinear:
    if not isinstance(layer, ShardedLinear):
        raise TypeError(f"{type(layer).__name__} is not a parallel linear layer to quantize")
    return layer


def quantize_model(model: nn.Module, context: PipelineContext) -> None:
    """The ``transform_model`` callback: 8-bit layers in place of the projections."""
    quantize_linear_layers(model, context.config)
