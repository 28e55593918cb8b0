"""MXFP4 checkpoints (``quant_method: mxfp4``, GPT-OSS's official weights): each expert
projection ``<name>`` stored as ``<name>_blocks`` uint8 [experts, rows, groups, 16] (two FP4
e2m1 values a byte, the low nibble first, 32 to a group) and ``<name>_scales`` uint8
[experts, rows, groups] (a power of two, exponent + 127), the rows being the projection's
outputs; the full-precision tensor is [experts, inputs, rows] as transformers holds it.

nxdplug has no FP4 layer: the experts are dequantized at load (exactly: every FP4 value times a
power of two is a float32), said in the log.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import torch

from nxdplug.plugins.quantization.formats.common import log_dequantized, module_name

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

BLOCKS, SCALES = "_blocks", "_scales"
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = torch.tensor(FP4_E2M1 + tuple(-v for v in FP4_E2M1))
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[experts, rows, groups, 16] blocks and [experts, rows, groups] scales -> float32
    [experts, groups * 32, rows]."""
    codes = blocks.to(torch.uint8).long()  # indices (uint8 would index as a mask)
    values = torch.stack((FP4_VALUES[codes & 0x0F], FP4_VALUES[codes >> 4]), dim=-1)
    exponents = scales.to(torch.int32) - SCALE_BIAS
    weights = torch.ldexp(values.flatten(-2), exponents[..., None])
    return weights.flatten(-2).transpose(1, 2).contiguous()


class Mxfp4Reader:
    """The ``QuantizedCheckpointFormat`` reader of MXFP4 checkpoints."""

    def __init__(self, declared: Mapping[str, Any], tensor_names: Collection[str]) -> None:
        self.declared = declared

    def settings(self) -> dict[str, Any]:
        return {}

    def convert(
        self, state_dict: dict[str, torch.Tensor], config: InferenceConfig
    ) -> dict[str, torch.Tensor]:
        converted = dict(state_dict)
        names = [key.removesuffix(BLOCKS) for key in state_dict if key.endswith(BLOCKS)]
        for name in names:
            blocks, scales = converted.pop(f"{name}{BLOCKS}"), converted.pop(f"{name}{SCALES}")
            converted[name] = dequantize_mxfp4(blocks, scales)
        why = "no FP4 layer; exact in float32"
        log_dequantized("MXFP4", [module_name(name) for name in names], why)
        return converted
