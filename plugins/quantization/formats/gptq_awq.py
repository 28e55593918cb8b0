"""GPTQ and AWQ checkpoints (``quant_method: gptq`` / ``awq``, what GPTQModel, AutoGPTQ and
AutoAWQ write): 4-bit weights packed eight to an int32, with per-group scales and zero points,
stored input features first ([in, out]).

- GPTQ: ``qweight`` int32 [in / 8, out] (packed along the input features), ``qzeros`` int32
  [groups, out / 8], ``scales`` [groups, out], ``g_idx`` [in] (each input feature's group;
  out of order with ``desc_act``). Its original ``checkpoint_format`` "gptq" stores each zero
  point minus one; "gptq_v2" stores it as it is.
- AWQ (``version: gemm``): ``qweight`` int32 [in, out / 8] and ``qzeros`` [groups, out / 8],
  packed along the output features in AWQ's order (nibble ``n`` of a word holds column
  ``AWQ_ORDER[n]`` of its eight), ``scales`` [groups, out]; no zero points without
  ``zero_point``.

``W = (Q - Z) * S`` with Q and Z unsigned. Weights in groups of a multiple of 32 (or one group
a row) with groups in order load into the int4 layers, with their zero points
(``quantization_zero_points``) when GPTQ's ``sym`` is false or AWQ's ``zero_point`` true
(symmetric GPTQ stores Z = 8, which the layers do not hold); activation-ordered GPTQ groups
(``desc_act``) and other group sizes are dequantized at load, with a log line.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from nxdplug.plugin_api import CheckpointError, ConfigError
from nxdplug.plugins.quantization.formats.common import (
    dequantize,
    full_precision_projections,
    groups_in_order,
    log_dequantized,
    module_name,
    module_parts,
)
from nxdplug.plugins.quantization.int4 import OFFSET, pack_int4
from nxdplug.plugins.quantization.targets import is_quantized_module

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

BITS = 4
PER_WORD = 32 // BITS
SHIFTS = torch.arange(0, 32, BITS, dtype=torch.int32)
# AWQ's order of the eight output columns in a word, and its inverse.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_COLUMN_NIBBLE = tuple(AWQ_ORDER.index(column) for column in range(PER_WORD))


def nibbles_of_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [n / 8, cols] packed along the rows -> unsigned values [n, cols]."""
    values = (packed[:, None, :] >> SHIFTS[None, :, None]) & 0xF
    return values.reshape(-1, packed.shape[1])


def nibbles_of_columns(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [rows, n / 8] packed along the columns -> unsigned values [rows, n]; ``order``
    gives the nibble of each of a word's eight columns (in order when None)."""
    values = (packed[:, :, None] >> SHIFTS) & 0xF
    if order is not None:
        values = values[:, :, list(order)]
    return values.reshape(packed.shape[0], -1)


class PackedInt4Reader(ABC):
    """What the GPTQ and AWQ readers share; subclasses unpack their layout."""

    tool: ClassVar[str]
    parts: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, declared: Mapping[str, Any], tensor_names: Collection[str]) -> None:
        self.declared = declared
        self.tensor_names = tensor_names
        bits = declared.get("bits", declared.get("w_bit", BITS))
        if bits != BITS:
            self._refuse(f"{bits}-bit weights are not read yet (4-bit only)")
        group = declared.get("group_size", declared.get("q_group_size", 128))
        self.group = None if group in (None, -1) else int(group)

    def _refuse(self, why: str) -> None:
        raise ConfigError(
            [f"{self.tool} checkpoint: {why}; dequantize it with the tool that wrote it"],
            "config.json's quantization_config",
        )

    @abstractmethod
    def has_zero_points(self) -> bool:
        """Whether the checkpoint's quantization_config says the weights are asymmetric."""

    def native_settings(self) -> dict[str, Any] | None:
        if self.declared.get("desc_act"):
            return None  # groups out of order: the int4 kernel takes them in order
        int4 = {"quantization_dtype": "int4", "quantization_zero_points": self.has_zero_points()}
        if self.group is None:
            return int4 | {"quantization_type": "per_channel_symmetric"}
        if self.group % 32 == 0:
            return int4 | {
                "quantization_type": "blockwise_symmetric",
                "quantization_block_size": self.group,
            }
        return None

    def why_not(self) -> str:
        """Why the weights are not held as stored (when :meth:`native_settings` is None)."""
        if self.declared.get("desc_act"):
            return "activation-ordered groups (desc_act): the int4 kernel takes groups in order"
        return f"groups of {self.group}: the int4 kernel takes multiples of 32"

    def settings(self) -> dict[str, Any]:
        native = self.native_settings()
        if native is None:
            return {}
        if self.tensor_names:
            skip = full_precision_projections(self.tensor_names, ".qweight")
        else:
            skip = ["lm_head"]
        return {"quantized": True, **native, "modules_to_not_convert": skip}

    @abstractmethod
    def unpack(
        self, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(Q [in, out], Z [groups, out] or None, S [groups, out])``, Q and Z unsigned."""

    def convert(
        self, state_dict: dict[str, torch.Tensor], config: InferenceConfig
    ) -> dict[str, torch.Tensor]:
        skip = config.neuron_config.modules_to_not_convert
        native = config.neuron_config.quantized and self.native_settings() is not None
        converted, parts = module_parts(state_dict, self.parts)
        dequantized = []
        for module, tensors in parts.items():
            q, z, s = self.unpack(tensors)
            in_features = q.shape[0]
            group = self.group or in_features
            g_idx = tensors.get("g_idx")
            in_order = groups_in_order(g_idx, group)
            # Signed, [out, ...] as the int4 layers' checkpoints are.
            weight, scale = (q.to(torch.int8) - OFFSET).T, s.float().T
            zero_point = None if z is None else (z.to(torch.int8) - OFFSET).T
            if native and not in_order:
                raise CheckpointError(
                    f"{module}.g_idx puts the input features out of order, but the "
                    "checkpoint's quantization_config says desc_act=false"
                )
            if native and is_quantized_module(module, skip):
                converted[f"{module}.weight"] = pack_int4(weight.contiguous())
                converted[f"{module}.weight_scale"] = scale.contiguous()
                if zero_point is not None and zero_point.any():
                    converted[f"{module}.weight_zero_point"] = zero_point.contiguous()
            else:
                converted[f"{module}.weight"] = dequantize(
                    weight, scale, zero_point, group=group, g_idx=None if in_order else g_idx
                )
                dequantized.append(module_name(module))
        log_dequantized(self.tool, dequantized, "not held quantized" if native else self.why_not())
        return converted


class GptqReader(PackedInt4Reader):
    tool = "GPTQ"

    def __init__(self, declared: Mapping[str, Any], tensor_names: Collection[str]) -> None:
        super().__init__(declared, tensor_names)
        checkpoint_format = declared.get("checkpoint_format", "gptq")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            self._refuse(f"checkpoint_format {checkpoint_format!r} is not read (gptq, gptq_v2)")
        # The original format stores each zero point minus one.
        self.zero_offset = 1 if checkpoint_format == "gptq" else 0

    def has_zero_points(self) -> bool:
        return not self.declared.get("sym", True)

    def unpack(
        self, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        q = nibbles_of_rows(tensors["qweight"])
        z = (nibbles_of_columns(tensors["qzeros"]) + self.zero_offset) & 0xF
        return q, z, tensors["scales"]


class AwqReader(PackedInt4Reader):
    tool = "AWQ"

    def __init__(self, declared: Mapping[str, Any], tensor_names: Collection[str]) -> None:
        super().__init__(declared, tensor_names)
        version = str(declared.get("version", "gemm")).lower()
        if version != "gemm":
            self._refuse(f"version {version!r} is not read (gemm)")
        self.zero_point = declared.get("zero_point", True)

    def has_zero_points(self) -> bool:
        return bool(self.zero_point)

    def unpack(
        self, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        q = nibbles_of_columns(tensors["qweight"], AWQ_COLUMN_NIBBLE)
        zeros = tensors.get("qzeros") if self.zero_point else None
        z = None if zeros is None else nibbles_of_columns(zeros, AWQ_COLUMN_NIBBLE)
        return q, z, tensors["scales"]
