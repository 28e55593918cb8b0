"""compressed-tensors checkpoints (``quant_method: compressed-tensors``, what llm-compressor
writes and vLLM reads).

Weights-only schemes that the quantization layers hold as they are load natively:

- ``int-quantized`` int8, symmetric, per channel or per tensor (``weight`` int8 and
  ``weight_scale``): the int8 layers;
- ``float-quantized`` fp8 e4m3, symmetric, per channel or per tensor: the f8e4m3 layers;
- ``pack-quantized`` int4, per channel or in groups of a multiple of 32 input features
  (``weight_packed`` int32 [out, in / 8], ``weight_scale``, ``weight_shape``, and
  ``weight_zero_point`` when asymmetric): the int4 layers, whose checkpoint packing is this
  one, with zero points (``quantization_zero_points``) when ``symmetric`` is false.

Anything else that is integer or fp8 (8-bit zero points, blocks, activation-ordered groups
whose ``weight_g_idx`` is not in order, several schemes in one model) is dequantized to full
precision at load, with a log line; input activation scales (W8A8) are dropped, and the model
multiplies in full precision. 4-bit floats (NVFP4, MXFP4) are refused.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import torch

from nxdplug.plugin_api import CheckpointError, ConfigError
from nxdplug.plugins.quantization.formats.common import (
    dequantize,
    full_precision_projections,
    groups_in_order,
    log,
    log_dequantized,
    module_name,
    module_parts,
)
from nxdplug.plugins.quantization.int4 import unpack_int4
from nxdplug.plugins.quantization.targets import is_quantized_module

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

TOOL = "compressed-tensors"
PACKED = "weight_packed"
SCALE = "weight_scale"
ZERO_POINT = "weight_zero_point"
G_IDX = "weight_g_idx"
SHAPE = "weight_shape"
WEIGHT_PARTS = (PACKED, SCALE, ZERO_POINT, G_IDX, SHAPE)
# Per-module tensors of what nxdplug does not take from these checkpoints: activation and KV
# cache scales.
DROPPED = ("input_scale", "input_zero_point", "output_scale", "k_scale", "v_scale")


class WeightScheme:
    """One config group's ``weights`` arguments."""

    def __init__(self, weights: Mapping[str, Any], fmt: str | None) -> None:
        self.bits = int(weights.get("num_bits", 8))
        self.type = weights.get("type", "int")
        self.symmetric = bool(weights.get("symmetric", True))
        self.strategy = weights.get("strategy", "tensor")
        self.group_size = weights.get("group_size")
        self.block = weights.get("block_structure")
        self.format = fmt

    def key(self) -> tuple:
        return (self.bits, self.type, self.symmetric, self.strategy, self.group_size, self.format)

    def native_settings(self) -> dict[str, Any] | None:
        """The NeuronConfig settings of the layers that hold these weights as stored, or None."""
        granularity = {"channel": "per_channel", "tensor": "per_tensor"}.get(self.strategy)
        if (
            self.bits == 8
            and self.symmetric
            and granularity
            and (self.type, self.format)
            in (
                ("int", "int-quantized"),
                ("float", "float-quantized"),
            )
        ):
            dtype = "int8" if self.type == "int" else "f8e4m3"
            return {"quantization_dtype": dtype, "quantization_type": f"{granularity}_symmetric"}
        if (self.bits, self.type, self.format) != (4, "int", "pack-quantized"):
            return None
        int4 = {"quantization_dtype": "int4", "quantization_zero_points": not self.symmetric}
        if self.strategy == "channel":
            return int4 | {"quantization_type": "per_channel_symmetric"}
        if self.strategy == "group" and self.group_size and self.group_size % 32 == 0:
            return int4 | {
                "quantization_type": "blockwise_symmetric",
                "quantization_block_size": self.group_size,
            }
        return None


class CompressedTensorsReader:
    """The ``QuantizedCheckpointFormat`` reader of compressed-tensors checkpoints."""

    def __init__(self, quantization_config: Mapping[str, Any], tensor_names: Collection[str]):
        self.config = quantization_config
        self.tensor_names = tensor_names
        default_format = quantization_config.get("format")
        groups = (quantization_config.get("config_groups") or {}).values()
        self.schemes = [
            WeightScheme(group["weights"], group.get("format") or default_format)
            for group in groups
            if group.get("weights")
        ]
        for scheme in self.schemes:
            unread = (scheme.type == "float" and scheme.bits == 4) or (
                scheme.format == "pack-quantized" and (scheme.type, scheme.bits) != ("int", 4)
            )
            if unread:
                raise ConfigError(
                    [
                        f"compressed-tensors {scheme.bits}-bit {scheme.type} weights in "
                        f"{scheme.format} are not read yet (NVFP4, MXFP4 and packings other "
                        "than int4); dequantize the checkpoint first"
                    ],
                    "config.json's quantization_config",
                )
        keys = {scheme.key() for scheme in self.schemes}
        self.native = self.schemes[0].native_settings() if len(keys) == 1 else None

    def settings(self) -> dict[str, Any]:
        if self.native is None:
            return {}
        return {
            "quantized": True,
            **self.native,
            "modules_to_not_convert": self._full_precision_modules(),
        }

    def _full_precision_modules(self) -> list[str]:
        if self.tensor_names:
            suffix = f".{PACKED}" if self.native["quantization_dtype"] == "int4" else f".{SCALE}"
            return full_precision_projections(self.tensor_names, suffix)
        # Without the tensor names, the config's ignore list (regular expressions cannot be
        # resolved to modules here, but for the LM head they always name).
        ignored = [e for e in self.config.get("ignore") or () if not e.startswith("re:")]
        return sorted({e.removeprefix("model.") for e in ignored} | {"lm_head"})

    def convert(
        self, state_dict: dict[str, torch.Tensor], config: InferenceConfig
    ) -> dict[str, torch.Tensor]:
        skip = config.neuron_config.modules_to_not_convert
        native = config.neuron_config.quantized and self.native is not None
        converted, parts = module_parts(state_dict, WEIGHT_PARTS)
        dropped = [key for key in converted if key.rpartition(".")[2] in DROPPED]
        for key in dropped:
            del converted[key]
        dequantized = []
        for module, tensors in parts.items():
            weight = converted.pop(f"{module}.weight", None)
            if native and is_quantized_module(module, skip) and self._as_stored(tensors):
                converted.update(self._native(module, weight, tensors))
            else:
                converted[f"{module}.weight"] = self._dequantized(module, weight, tensors)
                dequantized.append(module_name(module))
        why = "its scheme has no nxdplug layer" if not native else "not a projection held quantized"
        log_dequantized(TOOL, dequantized, why)
        if dropped:
            log.info(
                "%s checkpoint: activation and KV cache scales not used (%d tensors); "
                "activations are multiplied in full precision",
                TOOL,
                len(dropped),
            )
        return converted

    def _as_stored(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether the module's groups are in order (no reordering ``weight_g_idx``)."""
        g_idx = tensors.get(G_IDX)
        if g_idx is None:
            return True
        return groups_in_order(g_idx, self.schemes[0].group_size or g_idx.numel())

    def _native(
        self, module: str, weight: torch.Tensor | None, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        scale = tensors[SCALE].float()
        if PACKED in tensors:
            packed = tensors[PACKED]
            in_features = int(tensors[SHAPE][1]) if SHAPE in tensors else packed.shape[1] * 8
            if in_features != packed.shape[1] * 8:
                raise CheckpointError(
                    f"{module}.{PACKED}: {in_features} input features, not a multiple of 8, "
                    "cannot be held packed; add the module to modules_to_not_convert"
                )
            native = {f"{module}.weight": packed, f"{module}.weight_scale": scale}
            if ZERO_POINT in tensors:
                zero_point = unpacked_zero_points(tensors[ZERO_POINT], packed.shape[0])
                native[f"{module}.weight_zero_point"] = zero_point
            return native
        return {f"{module}.weight": weight, f"{module}.weight_scale": scale}

    def _dequantized(
        self, module: str, weight: torch.Tensor | None, tensors: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        scheme = self.schemes[0] if len(self.schemes) == 1 else None
        zero_point = tensors.get(ZERO_POINT)
        if PACKED in tensors:
            rows, features = (int(v) for v in tensors[SHAPE])
            quantized = unpack_int4(tensors[PACKED])[:, :features]
            if zero_point is not None:
                zero_point = unpacked_zero_points(zero_point, rows)
        elif weight is not None:
            quantized = weight
        else:
            raise CheckpointError(f"{module} has a {SCALE} but no weight in the checkpoint")
        block = tuple(scheme.block) if scheme is not None and scheme.block else None
        group = scheme.group_size if scheme is not None else None
        return dequantize(
            quantized,
            tensors[SCALE],
            zero_point,
            group=group,
            block=block,
            g_idx=tensors.get(G_IDX),
        )


def unpacked_zero_points(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """int4 zero points packed along the output rows ([ceil(rows / 8), groups]) -> signed
    [rows, groups]."""
    return unpack_int4(packed.T.contiguous()).T[:rows]
