"""Linear layers that keep their weight in 8 bits and dequantize it at each call, and the model
transform that puts them in place of the full-precision projections.

The 8-bit ``weight`` and float32 ``weight_scale`` are parameters (``requires_grad=False``) under
the checkpoint's own names, so checkpoint loading and the compiled graphs (which take every
parameter as an input) handle them like any other weight.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from nxdplug.errors import ConfigError
from nxdplug.modules.parallel_linear import (
    ColumnParallelLinear,
    RowParallelLinear,
)
from nxdplug.plugins.quantization.kernel import int8_matmul_op
from nxdplug.plugins.quantization.methods import QUANTIZED_DTYPES, dequantize_weight
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
        return dequantize_weight(self.weight, self.weight_scale, dtype)

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


class QuantizedColumnParallelLinear(QuantizedWeight, ColumnParallelLinear):
    """ColumnParallelLinear with an 8-bit weight; ``weight_scale`` is [out] or [1]."""


class QuantizedRowParallelLinear(QuantizedWeight, RowParallelLinear):
    """RowParallelLinear with an 8-bit weight; ``weight_scale`` ([out] or [1]) is whole on every
    rank, since each rank holds all the output rows."""


QUANTIZED_TWINS: dict[
    type[nn.Module], type[QuantizedColumnParallelLinear] | type[QuantizedRowParallelLinear]
] = {
    ColumnParallelLinear: QuantizedColumnParallelLinear,
    RowParallelLinear: QuantizedRowParallelLinear,
}


@functools.cache
def quantized_twin(cls: type[nn.Module]) -> type[nn.Module] | None:
    """The quantized class of a parallel linear class: its twin above; for a subclass that
    another feature made (a projection with LoRA adapters), that class with the 8-bit weight
    added, so that what the subclass adds stays; None for anything else or if quantized."""
    if cls in QUANTIZED_TWINS:
        return QUANTIZED_TWINS[cls]
    if issubclass(cls, QuantizedWeight) or not issubclass(
        cls, (ColumnParallelLinear, RowParallelLinear)
    ):
        return None
    return type(f"Quantized{cls.__name__}", (QuantizedWeight, cls), {"__module__": __name__})


def quantize_linear_layers(model: nn.Module, config: Any) -> None:
    """Put quantized layers in place of the projections the config quantizes, before the
    weights are loaded.

    An entry of ``modules_to_not_convert`` that names no module of the model is an error: a
    typo would otherwise quantize the module it meant to keep.
    """
    neuron_config = config.neuron_config
    dtype = QUANTIZED_DTYPES[neuron_config.quantization_dtype]
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
        if quantized_twin(type(module)) is not None and is_quantized_module(name, skip):
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


def quantize_model(model: nn.Module, context: Any) -> None:
    """The ``transform_model`` callback: 8-bit layers in place of the projections."""
    quantize_linear_layers(model, context.config)
