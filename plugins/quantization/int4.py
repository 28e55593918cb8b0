"""4-bit weights: the checkpoint's packing, the plugin's kernel layout, its matmul and
dequantization.

A weight ``W`` [out, in] is stored as signed 4-bit integers ``Q`` in -8..7 with one scale per
``group`` consecutive input features of a row (``scale`` [out, in / group]), ``W ≈ Q * scale``;
other tools' checkpoints may add a signed zero point per group, ``W = (Q - zero_point) * scale``
(asymmetric weights; the layers hold them only with ``quantization_zero_points=True``).

- In a checkpoint, ``Q`` is packed as compressed-tensors' ``pack-quantized`` format packs it
  (what llm-compressor writes and vLLM reads): ``Q + 8`` as unsigned nibbles, eight per int32
  along the input features, the first in the lowest bits ([out, in / 8]).
- In memory, ``Q + 8`` is in the layout of the plugin's kernels (``int4_kernels.cpp``, which
  describes it): blocks of 128 input features as 64 bytes, rows in tiles of four; the scales
  (float16, or float32 in a float32 model) and the zero points of asymmetric weights (int8)
  [out, groups] in the same tile order; symmetric weights hold none (the kernels take None).
  The matmul reads it as it is: integer digits of the activations for a few rows, bfloat16
  tiles dequantized in the cache for more; long prompts dequantize it for a GEMM.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from nxdplug.plugin_api import NotSupportedError, build_operators
from nxdplug.plugins.quantization.kernel import tile_rows, untile_rows

PACK_FACTOR = 8  # 4-bit values per int32
OFFSET = 8  # Q + OFFSET is the unsigned nibble
KERNEL_BLOCK = 128  # input features per 64 bytes of the kernel layout
KERNEL_CHUNK = 64  # input features per activation scale; groups are 32 or a multiple of this
KERNEL_SOURCE = Path(__file__).with_name("int4_kernels.cpp")
KERNEL_LIBRARY = "nxdplug_int4"


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q int8 [out, in], scale float32 [out, ceil(in / group)])``: round to nearest,
    symmetric, each group's largest magnitude at 7.5 steps (compressed-tensors' symmetric int4
    scale) rounded up to a float16 value, which the kernels hold (at least float16's smallest
    normal number); a last group shorter than ``group`` has its own scale; an all-zero group
    gets 1."""
    out_features, in_features = weight.shape
    groups = -(-in_features // group)
    padded = torch.nn.functional.pad(weight.float(), (0, groups * group - in_features))
    grouped = padded.reshape(out_features, groups, group)
    amax = grouped.abs().amax(dim=-1)
    smallest = torch.finfo(torch.float16).tiny
    scale = torch.where(amax > 0, (amax / 7.5).clamp(min=smallest), torch.ones_like(amax))
    half = scale.to(torch.float16)
    half = torch.where(half.float() < scale, torch.nextafter(half, half.new_tensor(1e4)), half)
    scale = half.float()
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


def padded_features(in_features: int) -> int:
    """The input features the kernel layout holds: whole blocks of KERNEL_BLOCK, the columns
    past ``in_features`` zero."""
    return -(-in_features // KERNEL_BLOCK) * KERNEL_BLOCK


def kernel_group_size(group: int, in_features: int) -> int:
    """The group size the kernels run for groups of ``group`` input features: ``group`` itself
    when it is 32 or a multiple of 64; 32 for the other multiples of 32 (each scale repeated);
    the padded row for one group per row (``group >= in_features``)."""
    if group >= in_features:
        return padded_features(in_features)
    if group == KERNEL_CHUNK // 2 or group % KERNEL_CHUNK == 0:
        return group
    if group % (KERNEL_CHUNK // 2) == 0:
        return KERNEL_CHUNK // 2
    raise NotSupportedError(
        f"int4 groups of {group} input features: the int4 kernels take groups of a multiple of 32"
    )


def kernel_groups(kernel_group: int, padded_in_features: int) -> int:
    """Scales per row in the kernel layout."""
    return -(-padded_in_features // kernel_group)


def to_kernel_layout(q: torch.Tensor, padded_in_features: int) -> torch.Tensor:
    """Signed 4-bit values [out, in] (zero columns added up to ``padded_in_features``) -> the
    kernel layout, uint8 [out, padded_in / 2]: in each block of 128 features, byte ``i`` holds
    feature ``i`` in its low nibble and ``64 + i`` in its high one; the rows tiled."""
    rows, columns = q.shape
    padded = torch.nn.functional.pad(q.to(torch.int16), (0, padded_in_features - columns))
    halves = (padded + OFFSET).to(torch.uint8).reshape(rows, -1, 2, KERNEL_CHUNK)
    packed = halves[:, :, 0] | (halves[:, :, 1] << 4)
    return tile_rows(packed.reshape(rows, -1).contiguous())


def from_kernel_layout(packed: torch.Tensor) -> torch.Tensor:
    """The kernel layout -> signed 4-bit values as int8 [out, padded_in]."""
    rows = packed.shape[0]
    blocks = untile_rows(packed).reshape(rows, -1, 1, KERNEL_CHUNK)
    unsigned = torch.cat([blocks & 0xF, blocks >> 4], dim=2).reshape(rows, -1)
    return (unsigned.to(torch.int16) - OFFSET).to(torch.int8)


def scale_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels hold scales in: float32 in a float32 model (exactly a float32
    checkpoint's), else float16 (half the bytes; 11 significant bits, more than bfloat16's)."""
    return torch.float32 if model_dtype == torch.float32 else torch.float16


def per_kernel_group(
    values: torch.Tensor,
    group: int,
    kernel_group: int,
    padded_in_features: int,
    fill: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[out, groups] values per checkpoint group -> [out, kernel groups] in ``dtype``, each
    repeated over the kernel groups it covers, the groups past the checkpoint's ``fill``."""
    count = kernel_groups(kernel_group, padded_in_features)
    repeat = max(1, group // kernel_group) if values.shape[1] > 1 else count
    repeated = values.to(dtype).repeat_interleave(repeat, dim=1)[:, :count]
    missing = repeated.new_full((values.shape[0], count - repeated.shape[1]), fill)
    return torch.cat([repeated, missing], dim=1)


def kernel_scales(
    scale: torch.Tensor,
    group: int,
    kernel_group: int,
    padded_in_features: int,
    dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """[out, groups] scales -> the kernels' scales in ``dtype`` (:func:`scale_dtype`) [out,
    kernel groups] (:func:`per_kernel_group`, scale 1 past the checkpoint's groups), tiled.
    Scales beyond float16's range are refused (ValueError); others are rounded to it (see
    :func:`float16_rounding`)."""
    scales = per_kernel_group(scale, group, kernel_group, padded_in_features, 1.0, torch.float32)
    halves = scales.to(dtype)
    if not halves.isfinite().all() or ((halves == 0) & (scales != 0)).any():
        raise ValueError(
            f"int4 scales from {scale.abs().min().item():.3g} to {scale.abs().max().item():.3g} "
            f"do not fit {str(dtype).removeprefix('torch.')}, which the int4 kernels hold them in"
        )
    return tile_rows(halves.contiguous(), lane=1)


def kernel_zero_points(
    zero_point: torch.Tensor, group: int, kernel_group: int, padded_in_features: int
) -> torch.Tensor:
    """[out, groups] signed zero points -> the kernels' int8 zero points [out, kernel groups]
    (:func:`per_kernel_group`, 0 past the checkpoint's groups), tiled."""
    zeros = per_kernel_group(zero_point, group, kernel_group, padded_in_features, 0, torch.int8)
    return tile_rows(zeros.contiguous(), lane=1)


def float16_rounding(scale: torch.Tensor) -> float:
    """The largest relative change rounding ``scale`` to float16 makes (0 for the scales this
    plugin's quantizer writes, and for float16 and most bfloat16 checkpoints' scales)."""
    scale = scale.float()
    change = (scale.to(torch.float16).float() - scale).abs() / scale.abs().clamp(min=1e-30)
    return change.max().item() if change.numel() else 0.0


def from_kernel_scales(tiled: torch.Tensor) -> torch.Tensor:
    """The kernels' tiled scales or zero points -> [out, kernel groups]."""
    return untile_rows(tiled, lane=1)


@functools.cache
def int4_kernels() -> Any | None:
    """``torch.ops.nxdplug_int4`` with ``int4_matmul(x [M, K] float32 or bfloat16, packed,
    scales, zero_points, group)`` -> ``[M, out]`` in x's dtype and ``int4_dequantize(packed,
    scales, zero_points, group, in_features, dtype)`` -> W ``[out, in_features]`` (zero points
    None for symmetric weights), or None where they cannot be built (no C++ compiler or ninja, a
    CPU other than x86)."""
    return build_operators(
        KERNEL_LIBRARY,
        KERNEL_SOURCE,
        {"int4_matmul": _product_like, "int4_dequantize": _dequantized_like},
        purpose="int4 kernels",
        instead="int4 layers dequantize with PyTorch operations at each call, which is slower",
    )


def _product_like(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    group: int,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0]))


def _dequantized_like(
    packed: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    group: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    return packed.new_empty((packed.shape[0], in_features), dtype=dtype)


def dequantize_int4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    kernel_group: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The kernel-layout weight as a [out, in_features] matrix of ``dtype``: by the plugin's
    C++ loop on the CPU, else by PyTorch operations (``(Q - zero_point) * scale`` in float32,
    then cast, as the loop computes it; ``zero_points`` None: ``Q * scale``)."""
    kernels = int4_kernels() if packed.device.type == "cpu" else None
    if kernels is not None:
        return kernels.int4_dequantize(
            packed, scales, zero_points, kernel_group, in_features, dtype
        )
    q = from_kernel_layout(packed)[:, :in_features].float()
    if zero_points is not None:
        q = q - per_feature(zero_points, kernel_group, in_features)
    return (q * per_feature(scales, kernel_group, in_features)).to(dtype)


def per_feature(tiled: torch.Tensor, kernel_group: int, in_features: int) -> torch.Tensor:
    """The kernels' tiled scales or zero points as float32 [out, in_features]."""
    return from_kernel_scales(tiled).float().repeat_interleave(kernel_group, dim=1)[:, :in_features]
