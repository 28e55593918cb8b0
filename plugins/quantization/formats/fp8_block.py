"""Block-scaled FP8 checkpoints (``quant_method: fp8``, as DeepSeek-V3 and Qwen3's FP8 models
ship them): ``weight`` float8_e4m3fn [out, in] and ``weight_scale_inv`` [ceil(out / bo),
ceil(in / bi)] (float32, or float8_e8m0fnu powers of two) for ``weight_block_size`` [bo, bi];
``W = weight * weight_scale_inv`` block by block.

nxdplug's fp8 layers take one scale per row or per tensor, not per block, so these weights are
dequantized at load (said in the log); activation scales (static ``activation_scheme``) are not
used.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import torch

from nxdplug.plugins.quantization.formats.common import (
    dequantize,
    log,
    log_dequantized,
    module_name,
)

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

SCALE = "weight_scale_inv"
ACTIVATION_SCALE = "activation_scale"


class Fp8BlockReader:
    """The ``QuantizedCheckpointFormat`` reader of block-scaled FP8 checkpoints."""

    def __init__(self, declared: Mapping[str, Any], tensor_names: Collection[str]) -> None:
        size = declared.get("weight_block_size") or (128, 128)
        self.block = (int(size[0]), int(size[1]))

    def settings(self) -> dict[str, Any]:
        return {}

    def convert(
        self, state_dict: dict[str, torch.Tensor], config: InferenceConfig
    ) -> dict[str, torch.Tensor]:
        converted = dict(state_dict)
        modules = [key.removesuffix(f".{SCALE}") for key in state_dict if key.endswith(SCALE)]
        for module in modules:
            scale = converted.pop(f"{module}.{SCALE}")
            weight = converted[f"{module}.weight"]
            converted[f"{module}.weight"] = dequantize(weight, scale, block=self.block)
        activations = [key for key in converted if key.endswith(f".{ACTIVATION_SCALE}")]
        for key in activations:
            del converted[key]
        why = f"blocks of {self.block[0]}x{self.block[1]}: the fp8 layers scale rows or tensors"
        log_dequantized("FP8", [module_name(m) for m in modules], why)
        if activations:
            log.info("FP8 checkpoint: %d activation scales not used", len(activations))
        return converted
