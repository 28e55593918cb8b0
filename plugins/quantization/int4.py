"""4-bit weights: the checkpoint's packing, PyTorch's CPU int4 matmul, and dequantization.

A weight ``W`` [out, in] is stored as signed 4-bit integers ``Q`` in -8..7 with one scale per
``group`` consecutive input features of a row (``scale`` [out, in / group]), ``W ≈ Q * scale``.

- In a checkpoint, ``Q`` is packed as compressed-tensors' ``pack-quantized`` format packs it
  (what llm-compressor writes and vLLM reads): ``Q + 8`` as unsigned nibbles, eight per int32
  along the input features, the first in the lowest bits ([out, in / 8]).
- In memory, ``Q + 8`` is in the layout of ``aten._convert_weight_to_int4pack_for_cpu``
  ([out, in / 2] uint8), which ``aten._weight_int4pack_mm_for_cpu`` multiplies by a few rows
  reading 4 bits a weight. That layout is not documented: :func:`from_kernel_layout` reads it
  back for prompts (dequantize, then a GEMM), and :func:`check_kernel_layout` confirms, once per
  process, that this PyTorch packs the way it reads.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from nxdplug.errors import NotSupportedError
from nxdplug.runtime.cpp_ops import build_operator

PACK_FACTOR = 8  # 4-bit values per int32
OFFSET = 8  # Q + OFFSET is the unsigned nibble
KERNEL_GROUP_SIZES = (256, 128, 64, 32)  # what the CPU kernel takes, largest first
KERNEL_BLOCK_ROWS = 64  # the kernel layout interleaves rows in blocks of this many
DEQUANTIZE_SOURCE = Path(__file__).with_name("int4_dequantize.cpp")
DEQUANTIZE_LIBRARY = "nxdplug_int4"


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q int8 [out, in], scale float32 [out, ceil(in / group)])``: round to nearest,
    symmetric, each group's largest magnitude at 7.5 steps (compressed-tensors' symmetric int4
    scale); a last group shorter than ``group`` has its own scale; an all-zero group gets 1."""
    out_features, in_features = weight.shape
    groups = -(-in_features // group)
    padded = torch.nn.functional.pad(weight.float(), (0, groups * group - in_features))
    grouped = padded.reshape(out_features, groups, group)
    amax = grouped.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / 7.5, torch.ones_like(amax))
    q = (grouped / scale[..., None]).round().clamp(-8, 7).reshape(out_features, -1)
    return q[:, :in_features].to(torch.int8), scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit values [out, in] -> int32 [out, in / 8], compressed-tensors' packing."""
    nibbles = (q.to(torch.int32) + OFFSET).reshape(q.shape[0], -1, PACK_FACTOR)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    return (nibbles << shifts).sum(dim=-1, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [out, in / 8] -> signed 4-bit values as int8 [out, in]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed[..., None] >> shifts) & 0xF
    return (nibbles - OFFSET).to(torch.int8).reshape(packed.shape[0], -1)


def to_kernel_layout(q: torch.Tensor, padded_in_features: int | None = None) -> torch.Tensor:
    """Signed 4-bit values [out, in] (zero columns added up to ``padded_in_features``) -> the
    CPU kernel's packed uint8 [out, padded_in / 2]."""
    pad = 0 if padded_in_features is None else padded_in_features - q.shape[1]
    unsigned = torch.nn.functional.pad(q.to(torch.int32), (0, pad)) + OFFSET
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 2)


def from_kernel_layout(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The CPU kernel's packed uint8 -> signed 4-bit values as int8 [out, in].

    Rows come in blocks of 64: for each input feature, 32 bytes hold rows ``j`` (low nibble)
    and ``j + 32`` (high nibble) of the block. Rows past the last whole block come in pairs:
    a byte holds rows ``2j`` and ``2j + 1``.
    """
    flat = packed.reshape(-1)
    in_features = flat.numel() * 2 // out_features
    blocked = out_features // KERNEL_BLOCK_ROWS * KERNEL_BLOCK_ROWS
    head = flat[: blocked * in_features // 2].reshape(-1, in_features, KERNEL_BLOCK_ROWS // 2)
    head = torch.cat([head & 0xF, head >> 4], dim=-1).transpose(1, 2)
    parts = [head.reshape(blocked, in_features)]
    if out_features > blocked:
        tail = flat[blocked * in_features // 2 :].reshape(in_features, -1)
        parts.append(torch.stack([tail & 0xF, tail >> 4], dim=-1).reshape(in_features, -1).t())
    return (torch.cat(parts).to(torch.int16) - OFFSET).to(torch.int8)


@functools.cache
def check_kernel_layout() -> None:
    """Refuse int4 weights where this PyTorch's packing is not the one
    :func:`from_kernel_layout` reads (or where it has no CPU int4 kernel)."""
    generator = torch.Generator().manual_seed(0)
    for rows in (KERNEL_BLOCK_ROWS * 2, KERNEL_BLOCK_ROWS + 16):
        q = torch.randint(-8, 8, (rows, 64), generator=generator, dtype=torch.int8)
        try:
            packed = to_kernel_layout(q)
        except (RuntimeError, AttributeError) as exc:
            raise NotSupportedError(
                f"int4 weights need PyTorch's CPU int4 matmul, which this build lacks ({exc}); "
                "use quantization_dtype='int8'"
            ) from exc
        if not torch.equal(from_kernel_layout(packed, rows), q):
            raise NotSupportedError(
                f"this PyTorch ({torch.__version__}) packs int4 weights in a layout nxdplug "
                "does not read; use quantization_dtype='int8' or the PyTorch nxdplug is tested "
                "with"
            )


def kernel_group_size(group: int, in_features: int) -> int:
    """The group size the kernel runs for groups of ``group`` input features: ``group`` itself
    when the kernel takes it, else the largest kernel size dividing it; for one group per row
    (``group >= in_features``), the largest kernel size dividing the row rounded up to 32 (the
    least padding), its scale repeated."""
    if group >= in_features:
        row = -(-in_features // 32) * 32
        return next(size for size in KERNEL_GROUP_SIZES if row % size == 0)
    for size in KERNEL_GROUP_SIZES:
        if group % size == 0:
            return size
    raise NotSupportedError(
        f"int4 groups of {group} input features: the CPU kernel takes groups of "
        f"{', '.join(map(str, KERNEL_GROUP_SIZES))} or a multiple of one of them"
    )


def padded_features(in_features: int, group: int, kernel_group: int) -> int:
    """The input features the kernel layout holds: whole groups (whole kernel groups for one
    group per row), the columns past ``in_features`` zero."""
    whole = kernel_group if group >= in_features else group
    return -(-in_features // whole) * whole


def kernel_scales(
    scale: torch.Tensor,
    group: int,
    kernel_group: int,
    padded_in_features: int,
    zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    """[out, groups] scales (and signed zero points, ``W = (Q - zero_point) * scale``) -> the
    kernel's ``scales_and_zeros`` [padded_in / kernel_group, out, 2], each repeated over the
    kernel groups it covers. The kernel computes ``Q * scale + zero``, so ``zero`` is
    ``-zero_point * scale`` (0 when symmetric)."""
    kernel_groups = padded_in_features // kernel_group
    zero = torch.zeros_like(scale) if zero_point is None else -zero_point.float() * scale
    pair = torch.stack([scale, zero], dim=-1)
    return (
        pair.repeat_interleave(kernel_groups // scale.shape[1], dim=1).transpose(0, 1).contiguous()
    )


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, kernel_group: int, scales: torch.Tensor
) -> torch.Tensor:
    """``x`` [rows, in] times the packed weight, in x's dtype (the scales must be in it too)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, kernel_group, scales)


@functools.cache
def int4_dequantize_op() -> Any | None:
    """``int4_dequantize(packed, scales_and_zeros, in_features)`` -> the weight transposed,
    [in, out], in the scales' dtype (``int4_dequantize.cpp``), or None where it cannot be
    built."""
    return build_operator(
        DEQUANTIZE_LIBRARY,
        DEQUANTIZE_SOURCE,
        "int4_dequantize",
        _dequantized_like,
        purpose="int4 dequantization",
        instead="int4 layers dequantize with PyTorch operations for prompts, which is slower",
    )


def _dequantized_like(packed: torch.Tensor, scales: torch.Tensor, in_features: int) -> torch.Tensor:
    return scales.new_empty((in_features, packed.shape[0]))


def dequantize_int4(
    packed: torch.Tensor, scales: torch.Tensor, in_features: int, dtype: torch.dtype
) -> torch.Tensor:
    """The kernel-layout weight as a [out, in] matrix of ``dtype`` (``Q * scale + zero`` in
    float32, then cast; the zero padding columns dropped): by the plugin's C++ loop on the CPU
    when the scales are in ``dtype`` (a transposed view of its [in, out] result), else by
    PyTorch operations."""
    op = int4_dequantize_op() if packed.device.type == "cpu" else None
    if op is not None and scales.dtype == dtype:
        return op(packed, scales, in_features).t()
    out_features = packed.shape[0]
    q = from_kernel_layout(packed, out_features)
    groups = scales.shape[0]
    scale, zero = (scales[..., i].t().float()[..., None] for i in (0, 1))
    grouped = q.reshape(out_features, groups, -1).float() * scale + zero
    return grouped.reshape(out_features, -1)[:, :in_features].to(dtype)
