"""How much memory a model's weights take as held, against the same weights dense."""

from __future__ import annotations

import attrs
from torch import nn

from nxdplug.plugins.quantization.layers import Int4Weight
from nxdplug.plugins.quantization.targets import SCALE_SUFFIX, ZERO_POINT_SUFFIX

MIB = 2**20


@attrs.frozen
class WeightMemory:
    """Parameter bytes: ``held`` as the model holds them (quantized weights and their scales
    included), and what the same weights would take dense in float32 and in bfloat16."""

    held: int
    float32: int
    bfloat16: int

    def summary(self) -> str:
        return (
            f"weights: {self.held / MIB:.2f} MiB held, against {self.float32 / MIB:.2f} MiB in "
            f"float32 ({self.held / self.float32:.2f}x) and {self.bfloat16 / MIB:.2f} MiB in "
            f"bfloat16 ({self.held / self.bfloat16:.2f}x)"
        )


def weight_memory(model: nn.Module) -> WeightMemory:
    """The :class:`WeightMemory` of ``model``'s parameters, each tied parameter counted once
    (an int4 weight stands for the [out, in] weights it packs two to a byte)."""
    held = dense = 0
    seen: set[int] = set()
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            held += parameter.numel() * parameter.element_size()
            if name.endswith((SCALE_SUFFIX, ZERO_POINT_SUFFIX)):
                continue
            method = getattr(module, "weight_method", None)
            if name == "weight" and isinstance(method, Int4Weight):
                dense += module.weight.shape[0] * method.multiplied_features
            else:
                dense += parameter.numel()
    return WeightMemory(held=held, float32=4 * dense, bfloat16=2 * dense)
