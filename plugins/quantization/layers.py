"""Linear layers that keep their weight in 8 or 4 bits (multiplied as it is by a kernel for a few
rows, dequantized for more), and the model transform that puts them in place of the
full-precision projections.

The quantized ``weight`` and its ``weight_scale`` are parameters (``requires_grad=False``) under
the checkpoint's own names, so checkpoint loading and the compiled graphs (which take every
parameter as an input) handle them like any other weight. 8-bit scales stay float32; int4
scales are in the kernel's layout and the model's dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from nxdplug.plugin_api import ColumnParallelLinear, ConfigError, RowParallelLinear
from nxdplug.plugins.quantization.int4 import (
    dequantize_int4,
    int4_kernels,
    kernel_group_size,
    kernel_groups,
    padded_features,
    scale_dtype,
)
from nxdplug.plugins.quantization.kernel import int8_matmul_op, tile_rows, untile_rows
from nxdplug.plugins.quantization.methods import QUANTIZED_DTYPES, dequantize_weight, int4_group
from nxdplug.plugins.quantization.targets import (
    has_row_scales,
    is_quantized_module,
    names_module,
)

# Up to this many rows the int8 matmul beats dequantizing for a bf16 GEMM (measured on this
# CPU, eager, 2048x768 weights: 28 against 295 us at 1 row, 110 against 320 at 8, 436 against
# 671 at 32; its cost grows by about a GEMV a row, the GEMM's barely).
INT8_KERNEL_MAX_ROWS = 32
INT8_KERNEL_INPUT_DTYPES = (torch.float32, torch.bfloat16)
INT4_KERNEL_INPUT_DTYPES = (torch.float32, torch.bfloat16)


class QuantizedWeight:
    """What the quantized layers add to their parallel linear base: the 8-bit weight, its scale
    and the dequantization."""

    # The scales stay float32 in a bf16 model: rounded to bf16, they moved every output of a row
    # by up to 2**-9.
    keeps_dtype = ("weight_scale",)
    weight: nn.Parameter
    weight_scale: nn.Parameter

    def _hold_quantized(self, dtype: torch.dtype, row_scales: bool) -> None:
        shape, device = self.weight.shape, self.weight.device
        self.weight = nn.Parameter(
            torch.empty(shape, dtype=dtype, device=device), requires_grad=False
        )
        rows = shape[0] if row_scales else 1
        if dtype == torch.int8:
            # Registers the int8 matmul now: a compiled graph that calls it by name can only
            # be loaded once it is there.
            int8_matmul_op()
        self.weight_scale = nn.Parameter(
            torch.ones(rows, dtype=torch.float32, device=device), requires_grad=False
        )

    def weight_for(self, dtype: torch.dtype) -> torch.Tensor:
        """The 8-bit weight dequantized for this call; the base layer's forward does the rest."""
        return dequantize_weight(self.rows(), self.weight_scale, dtype)

    def rows(self) -> torch.Tensor:
        """The 8-bit weight [out, in] in row order: int8 weights are held tiled for the int8
        matmul (:func:`.kernel.tile_rows`, done by the checkpoint converter)."""
        if self.weight.dtype == torch.int8:
            return untile_rows(self.weight)
        return self.weight

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's shard of the converted (tiled) tensors, tiled again: the rows or
        columns are cut in row order."""
        weight = full.get("weight")
        if weight is None or weight.dtype != torch.int8:
            return super().shard_state_dict(full)
        shard = super().shard_state_dict({**full, "weight": untile_rows(weight)})
        return {**shard, "weight": tile_rows(shard["weight"])}

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """A few rows (decoding) times an int8 weight on the CPU go to the plugin's int8 matmul
        (:mod:`.kernel`), which reads the 8-bit weight as it is, computes the products exactly
        in integers and scales each output by its row's float32 scale: the step reads half the
        bytes of a bf16 weight and makes no full-precision copy. Its cost grows with the rows
        (about a GEMV each), so prompts, fp8 weights, float16 inputs and other devices dequantize
        the weight for a GEMM."""
        rows = x.numel() // x.shape[-1]
        int8_matmul = (
            int8_matmul_op()
            if self.weight.dtype == torch.int8
            and x.device.type == "cpu"
            and x.dtype in INT8_KERNEL_INPUT_DTYPES
            and rows <= INT8_KERNEL_MAX_ROWS
            else None
        )
        if int8_matmul is None:
            return super().project(x, bias)
        out = int8_matmul(x.reshape(rows, x.shape[-1]), self.weight, self.weight_scale)
        out = out.reshape(*x.shape[:-1], -1)
        return out if bias is None else out + bias


class Int4Weight:
    """What the int4 layers add to their parallel linear base: the weight packed in the int4
    kernels' layout (uint8 [out, padded in / 2]), its scales (float16; float32 in a float32
    model) and int8 zero points ([out, groups], tiled), and the two ways to multiply
    (:mod:`.int4`)."""

    keeps_dtype = ("weight_scale",)
    weight: nn.Parameter
    weight_scale: nn.Parameter
    weight_zero_point: nn.Parameter
    kernel_group: int
    multiplied_features: int

    def _hold_int4(self, group: int, scale_dtype: torch.dtype) -> None:
        out_features, in_features = self.weight.shape
        # Registers the kernels now: a compiled graph that calls them by name can only be
        # loaded once they are there.
        int4_kernels()
        self.kernel_group = kernel_group_size(group, in_features)
        # The layout holds zero columns past the input features the layer multiplies.
        self.multiplied_features = in_features
        padded = padded_features(in_features)
        device = self.weight.device
        self.weight = nn.Parameter(
            torch.empty(out_features, padded // 2, dtype=torch.uint8, device=device),
            requires_grad=False,
        )
        groups = (out_features, kernel_groups(self.kernel_group, padded))
        self.weight_scale = nn.Parameter(
            torch.ones(groups, dtype=scale_dtype, device=device), requires_grad=False
        )
        self.weight_zero_point = nn.Parameter(
            torch.zeros(groups, dtype=torch.int8, device=device), requires_grad=False
        )

    def weight_for(self, dtype: torch.dtype) -> torch.Tensor:
        """The int4 weight dequantized for this call (prompts); the base layer does the rest."""
        return dequantize_int4(
            self.weight,
            self.weight_scale,
            self.weight_zero_point,
            self.kernel_group,
            self.multiplied_features,
            dtype,
        )

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
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
            return super().project(x, bias)
        out = kernels.int4_matmul(
            x.reshape(rows, x.shape[-1]),
            self.weight,
            self.weight_scale,
            self.weight_zero_point,
            self.kernel_group,
        )
        out = out.reshape(*x.shape[:-1], -1)
        return out if bias is None else out + bias


class QuantizedColumnParallelLinear(QuantizedWeight, ColumnParallelLinear):
    """ColumnParallelLinear with an 8-bit weight; ``weight_scale`` is [out] or [1]."""


class QuantizedRowParallelLinear(QuantizedWeight, RowParallelLinear):
    """RowParallelLinear with an 8-bit weight; ``weight_scale`` ([out] or [1]) is whole on every
    rank, since each rank holds all the output rows."""


class Int4ColumnParallelLinear(Int4Weight, ColumnParallelLinear):
    """ColumnParallelLinear with an int4 weight."""


class Int4RowParallelLinear(Int4Weight, RowParallelLinear):
    """RowParallelLinear with an int4 weight."""


QUANTIZED_TWINS: dict[tuple[type[nn.Module], type], type[nn.Module]] = {
    (ColumnParallelLinear, QuantizedWeight): QuantizedColumnParallelLinear,
    (RowParallelLinear, QuantizedWeight): QuantizedRowParallelLinear,
    (ColumnParallelLinear, Int4Weight): Int4ColumnParallelLinear,
    (RowParallelLinear, Int4Weight): Int4RowParallelLinear,
}


@functools.cache
def quantized_twin(cls: type[nn.Module], form: type = QuantizedWeight) -> type[nn.Module] | None:
    """The class of a parallel linear class with its weight in ``form`` (QuantizedWeight:
    8 bits; Int4Weight): its twin above; for a subclass that another feature made (a projection
    with LoRA adapters), that class with the form added, so that what the subclass adds stays;
    None for anything else or if quantized."""
    if (cls, form) in QUANTIZED_TWINS:
        return QUANTIZED_TWINS[cls, form]
    if issubclass(cls, (QuantizedWeight, Int4Weight)) or not issubclass(
        cls, (ColumnParallelLinear, RowParallelLinear)
    ):
        return None
    prefix = "Quantized" if form is QuantizedWeight else "Int4"
    return type(f"{prefix}{cls.__name__}", (form, cls), {"__module__": __name__})


def quantize_linear_layers(model: nn.Module, config: Any) -> None:
    """Put quantized layers in place of the projections the config quantizes, before the
    weights are loaded.

    An entry of ``modules_to_not_convert`` that names no module of the model is an error: a
    typo would otherwise quantize the module it meant to keep.
    """
    neuron_config = config.neuron_config
    int4 = neuron_config.quantization_dtype == "int4"
    dtype = None if int4 else QUANTIZED_DTYPES[neuron_config.quantization_dtype]
    per_channel = neuron_config.quantization_type == "per_channel_symmetric"
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
        if quantized_twin(type(module)) is None or not is_quantized_module(name, skip):
            continue
        if int4:
            group = int4_group(neuron_config, module.in_features)
            hold_int4(module, group, scale_dtype(neuron_config.torch_dtype))
        else:
            hold_quantized(module, dtype, has_row_scales(name, per_channel))


def hold_quantized(layer: nn.Module, dtype: torch.dtype, row_scales: bool) -> nn.Module:
    """``layer`` (a parallel linear) turned into its quantized twin, unloaded: an empty 8-bit
    weight and a scale per output row (``row_scales``) or one. The class is swapped in place,
    as torch.nn.utils.parametrize does: the layer keeps its shape, sharding and whatever
    another feature added to it; only the weight changes."""
    twin = quantized_twin(type(layer))
    if twin is None:
        raise TypeError(f"{type(layer).__name__} is not a parallel linear layer to quantize")
    layer.__class__ = twin
    layer._hold_quantized(dtype, row_scales)
    return layer


def hold_int4(layer: nn.Module, group: int, scale_dtype: torch.dtype = torch.float16) -> nn.Module:
    """``layer`` (a parallel linear) turned into its int4 twin, unloaded, with scales in
    ``scale_dtype`` for groups of ``group`` input features (as :func:`hold_quantized` does for
    8 bits)."""
    twin = quantized_twin(type(layer), Int4Weight)
    if twin is None:
        raise TypeError(f"{type(layer).__name__} is not a parallel linear layer to quantize")
    layer.__class__ = twin
    layer._hold_int4(group, scale_dtype)
    return layer


def quantize_model(model: nn.Module, context: Any) -> None:
    """The ``transform_model`` callback: 8-bit layers in place of the projections."""
    quantize_linear_layers(model, context.config)
