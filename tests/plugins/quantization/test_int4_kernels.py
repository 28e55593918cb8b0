"""The quantization plugin's int4 kernels (``plugins/quantization/int4_kernels.cpp``): the
layout read back exactly, the dequantization bit for bit against PyTorch operations, and the
matmul against the exact product in float64 of the weights the layout stands for: groups of 32,
64, 128, 96 (run as 32) and one per row, symmetric weights (no zero points: the ops take None)
and asymmetric ones (zero points), rows past the last tile of four, input features short of the
padded block, float32 and bfloat16 activations spanning four decades in each of the matmul's
four ways (integer digits for a few rows, bfloat16 dot products for more bfloat16 rows, panels
dequantized for the bf16 panel kernel for bfloat16 prompts, dequantization and a GEMM for many
float32 rows), non-finite inputs, and the portable loop that CPUs without AVX512-VNNI take."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nxdplug.errors import CheckpointError
from nxdplug.modules.parallel_linear import ColumnParallelLinear
from nxdplug.plugins.quantization.convert import fit_int4_weights
from nxdplug.plugins.quantization.int4 import (
    dequantize_int4,
    from_kernel_layout,
    from_kernel_scales,
    int4_kernels,
    kernel_group_size,
    kernel_scales,
    kernel_zero_points,
    pack_int4,
    padded_features,
    quantize_int4,
    to_kernel_layout,
)
from nxdplug.plugins.quantization.layers import hold_int4
from tests.fresh_process import cpu_has, run_and_load

CASES = [  # (out rows, in features, group, zero points); each path takes both kinds
    (64, 768, 32, False),
    (7, 176, 32, True),
    (130, 256, 64, True),
    (33, 1000, 128, False),
    (9, 300, 96, True),
    (12, 200, 10_000, False),  # one group per row
]

needs_vnni = pytest.mark.skipif(
    not cpu_has("avx512bw", "avx512_vnni"), reason="this CPU lacks AVX512-VNNI"
)


@pytest.fixture(scope="module")
def kernels():
    ops = int4_kernels()
    assert ops is not None, "the int4 kernels did not build on this machine"
    return ops


def operands(
    rows: int,
    features: int,
    group: int,
    zeros: bool,
    seed: int = 0,
    scale_dtype: torch.dtype = torch.float16,
):
    """``(packed, scales, zero points, kernel group, W)``: a random weight quantized in groups
    (with zero points in -3..3 if ``zeros``, else None), in the kernel layout with scales in
    ``scale_dtype``, and the float64 weight it stands for."""
    generator = torch.Generator().manual_seed(seed)
    group = min(group, features)
    q, scale = quantize_int4(torch.randn(rows, features, generator=generator), group)
    zero = torch.randint(-3, 4, scale.shape, generator=generator, dtype=torch.int8)
    zero = zero if zeros else torch.zeros_like(zero)
    kernel_group = kernel_group_size(group, features)
    padded = padded_features(features)
    scales = kernel_scales(scale, group, kernel_group, padded, scale_dtype)
    zero_points = kernel_zero_points(zero, group, kernel_group, padded) if zeros else None
    per_feature = [t.double().repeat_interleave(group, dim=1)[:, :features] for t in (scale, zero)]
    weight = (q.double() - per_feature[1]) * per_feature[0]
    return to_kernel_layout(q, padded), scales, zero_points, kernel_group, weight


def activations(count: int, features: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    magnitude = 10 ** torch.empty(count, features).uniform_(-2, 2, generator=generator)
    signs = torch.randint(0, 2, (count, features), generator=generator) * 2 - 1
    return (magnitude * signs).to(dtype)


@pytest.mark.parametrize(("rows", "features"), [(8, 128), (9, 256), (3, 384), (5, 128)])
def test_the_layout_reads_back_exactly(rows, features) -> None:
    generator = torch.Generator().manual_seed(rows)
    q = torch.randint(-8, 8, (rows, features - 40), generator=generator, dtype=torch.int8)
    packed = to_kernel_layout(q, features)
    assert packed.shape == (rows, features // 2) and packed.dtype == torch.uint8
    back = from_kernel_layout(packed)
    assert torch.equal(back[:, : q.shape[1]], q) and not back[:, q.shape[1] :].any()
    # A block's byte i holds feature i (low nibble) and 64 + i (high): the first tile's first row.
    if rows >= 4:
        first = packed.flatten()[:64].to(torch.int16)
        row = torch.nn.functional.pad(q[0].to(torch.int16), (0, 40)) + 8
        assert torch.equal(first & 0xF, row[:64]) and torch.equal(first >> 4, row[64:128])


@pytest.mark.parametrize(("rows", "features", "group", "zeros"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_the_dequantization_is_the_layouts_own(
    kernels, rows, features, group, zeros, dtype, scale_dtype
):
    packed, scales, zero_points, kernel_group, weight = operands(
        rows, features, group, zeros, scale_dtype=scale_dtype
    )
    out = kernels.int4_dequantize(packed, scales, zero_points, kernel_group, features, dtype)
    assert out.shape == (rows, features) and out.dtype == dtype
    assert torch.equal(out, weight.to(dtype))
    q = from_kernel_layout(packed)[:, :features].float()
    scale, zero = (
        from_kernel_scales(t).repeat_interleave(kernel_group, dim=1)[:, :features]
        for t in (scales, torch.zeros_like(scales, dtype=torch.int8) if not zeros else zero_points)
    )
    assert torch.equal(out, ((q - zero.float()) * scale.float()).to(dtype))


@pytest.mark.parametrize("zeros", [True, False])
def test_pytorch_operations_dequantize_where_the_kernels_do_not_run(monkeypatch, zeros) -> None:
    packed, scales, zero_points, kernel_group, weight = operands(9, 300, 96, zeros)
    monkeypatch.setattr("nxdplug.plugins.quantization.int4.int4_kernels", lambda: None)
    out = dequantize_int4(packed, scales, zero_points, kernel_group, 300, torch.float32)
    assert torch.equal(out, weight.float())


def product_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest error of ``out``, over the largest magnitude of ``expected``."""
    return ((out.double() - expected).abs().max() / expected.abs().max()).item()


@needs_vnni
@pytest.mark.parametrize(("rows", "features", "group", "zeros"), CASES)
@pytest.mark.parametrize("count", [1, 3, 8, 30, 150])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_the_matmul_is_the_exact_product_within_rounding(
    kernels, rows, features, group, zeros, count, scale_dtype
) -> None:
    """float32 rows keep 22 bits of each 64 features' largest value (or are multiplied by the
    dequantized weight), bfloat16 rows 14 (or multiply the weight rounded to bfloat16): the
    first within float32 accumulation error, the second within the output's bfloat16 step."""
    packed, scales, zero_points, kernel_group, weight = operands(
        rows, features, group, zeros, scale_dtype=scale_dtype
    )
    for dtype, tolerance in ((torch.float32, 2e-6), (torch.bfloat16, 8e-3)):
        x = activations(count, features, dtype)
        out = kernels.int4_matmul(x, packed, scales, zero_points, kernel_group)
        assert out.shape == (count, rows) and out.dtype == dtype
        assert product_error(out, x.double() @ weight.T) <= tolerance, (dtype, rows, features)


@needs_vnni
def test_bfloat16_rows_are_within_their_own_rounding(kernels) -> None:
    """Each bfloat16 output of the integer path (a few rows) is within one bfloat16 step of the
    exact product (plus 2^-14 of the largest output): the activations keep 14 bits of each 64
    features' largest value. Rounded to 8 bits, as llama.cpp's q8_0 rounds them, they would
    not."""
    packed, scales, zero_points, kernel_group, weight = operands(256, 2048, 32, False)
    x = activations(2, 2048, torch.bfloat16)
    expected = x.double() @ weight.T
    out = kernels.int4_matmul(x, packed, scales, zero_points, kernel_group).double()
    bound = expected.abs() * 2**-8 + expected.abs().max() * 2**-14
    assert ((out - expected).abs() <= bound).all()


@pytest.mark.skipif(not cpu_has("avx512bw", "avx512_bf16"), reason="this CPU lacks AVX512-BF16")
@pytest.mark.parametrize("count", [5, 17, 24, 128])
@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("rows", [9, 70])
def test_several_bfloat16_rows_multiply_the_weight_rounded_to_bfloat16(
    kernels, count, zeros, rows
) -> None:
    """From 5 rows, bfloat16 activations multiply each tile (from 24 rows, each panel of 32)
    dequantized to bfloat16 (as the dequantization rounds it), products exact and sums in
    float32: within one bfloat16 step (and float32 accumulation) of that product, with and
    without zero points, groups of 96, a partial last panel and rows past the last tile."""
    packed, scales, zero_points, kernel_group, _ = operands(rows, 1000, 96, zeros)
    weight = kernels.int4_dequantize(
        packed, scales, zero_points, kernel_group, 1000, torch.bfloat16
    ).double()
    x = activations(count, 1000, torch.bfloat16)
    expected = x.double() @ weight.T
    out = kernels.int4_matmul(x, packed, scales, zero_points, kernel_group).double()
    assert out.shape == (count, rows)
    bound = expected.abs() * 2**-8 + expected.abs().max() * 1e-6
    assert ((out - expected).abs() <= bound).all()


@pytest.mark.parametrize("count", [1, 3, 8, 30, 150])
def test_no_zero_points_are_zero_points_of_0_bit_for_bit(kernels, count) -> None:
    """Symmetric weights (zero points None, nothing read) give what zero points of 0 give, on
    each path of the matmul and in the dequantization."""
    packed, scales, _, kernel_group, _ = operands(13, 300, 32, False)
    zeros = torch.zeros_like(scales, dtype=torch.int8)
    for dtype in (torch.float32, torch.bfloat16):
        x = activations(count, 300, dtype)
        without = kernels.int4_matmul(x, packed, scales, None, kernel_group)
        assert torch.equal(without, kernels.int4_matmul(x, packed, scales, zeros, kernel_group))
        weight = kernels.int4_dequantize(packed, scales, None, kernel_group, 300, dtype)
        assert torch.equal(
            weight, kernels.int4_dequantize(packed, scales, zeros, kernel_group, 300, dtype)
        )


def test_non_finite_rows_give_non_finite_outputs(kernels) -> None:
    packed, scales, zero_points, kernel_group, weight = operands(8, 256, 32, False)
    x = activations(3, 256, torch.float32)
    x[0, 3] = float("nan")
    x[1, 200] = float("inf")
    out = kernels.int4_matmul(x, packed, scales, zero_points, kernel_group)
    assert out[0].isnan().all() and not out[1].isfinite().any()
    assert product_error(out[2:], x[2:].double() @ weight.T) <= 2e-6


def test_bad_operands_are_refused(kernels) -> None:
    packed, scales, zero_points, kernel_group, _ = operands(8, 256, 32, False)
    x = activations(1, 256, torch.float32)
    with pytest.raises(RuntimeError, match="uint8"):
        kernels.int4_matmul(x, packed.to(torch.int8), scales, zero_points, kernel_group)
    with pytest.raises(RuntimeError, match="groups of 32 or a multiple of 64"):
        kernels.int4_matmul(x, packed, scales, zero_points, 48)
    with pytest.raises(RuntimeError, match=r"float16 or float32 scales \[8, 8\]"):
        kernels.int4_matmul(x, packed, scales[:4], zero_points, kernel_group)
    with pytest.raises(RuntimeError, match=r"int8 zero points \[8, 8\] \(or None\)"):
        kernels.int4_matmul(x, packed, scales, torch.zeros(8, 4, dtype=torch.int8), kernel_group)
    with pytest.raises(RuntimeError, match=r"K <= 256"):
        kernels.int4_matmul(activations(1, 300, torch.float32), packed, scales, zero_points, 32)


PORTABLE_RUN = """
import sys
import torch
from nxdplug.plugins.quantization.int4 import int4_kernels
from tests.plugins.quantization.test_int4_kernels import CASES, activations, operands
ops = int4_kernels()
outputs = {}
for rows, features, group, zeros in CASES:
    packed, scales, zero_points, kernel_group, _ = operands(rows, features, group, zeros)
    for dtype in (torch.float32, torch.bfloat16):
        x = activations(3, features, dtype)
        product = ops.int4_matmul(x, packed, scales, zero_points, kernel_group)
        outputs[rows, features, dtype] = product
torch.save(outputs, sys.argv[1])
"""


def test_the_portable_loop_gives_the_product_too(kernels, tmp_path) -> None:
    """The loop of CPUs without AVX512-VNNI, forced on this one in a fresh process."""
    outputs = run_and_load(PORTABLE_RUN, tmp_path, NXDPLUG_INT4_MATMUL_PORTABLE="1")
    assert len(outputs) == 2 * len(CASES)
    for rows, features, group, zeros in CASES:
        *_, weight = operands(rows, features, group, zeros)
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 8e-3)):
            expected = activations(3, features, dtype).double() @ weight.T
            error = product_error(outputs[rows, features, dtype], expected)
            assert error <= tolerance, (rows, features, dtype, error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("count", [1, 200])
@pytest.mark.parametrize("zeros", [True, False])
def test_int4_layers_give_the_product_whichever_path_they_take(
    kernels, monkeypatch, dtype, count, zeros
) -> None:
    """An int4 layer gives float32 and bfloat16 rows to the int4 matmul and dequantizes its
    weight for float16 ones: each way, the product plus bias. A symmetric layer holds no zero
    points."""
    calls = []
    monkeypatch.setattr(
        "nxdplug.plugins.quantization.layers.int4_kernels",
        lambda: SimpleNamespace(
            int4_matmul=lambda *args: calls.append(1) or kernels.int4_matmul(*args)
        ),
    )
    layer = hold_int4(ColumnParallelLinear(300, 9, bias=True), group=96, zero_points=zeros)
    packed, scales, zero_points, _, weight = operands(9, 300, 96, zeros)
    bias = torch.randn(9)
    held = {"weight": packed, "weight_scale": scales, "bias": bias}
    if zeros:
        held["weight_zero_point"] = zero_points
    assert set(dict(layer.named_parameters())) == set(held)
    layer.load_state_dict(held)
    layer.to(dtype)
    layer.weight_scale.data = scales  # float32 whatever the model's dtype, as the loader keeps it
    x = activations(count, 300, dtype)
    out = layer(x.reshape(1, count, 300))
    assert out.dtype == dtype and out.shape == (1, count, 9)
    assert len(calls) == (0 if dtype == torch.float16 else 1)
    expected = x.double() @ weight.T + bias.to(dtype).double()
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert product_error(out[0], expected) <= tolerance


def int4_config(path: str = "/checkpoints/int4", **settings) -> SimpleNamespace:
    return SimpleNamespace(
        neuron_config=SimpleNamespace(
            quantization_dtype="int4",
            quantization_type="blockwise_symmetric",
            quantization_block_size=32,
            modules_to_not_convert=None,
            quantized_checkpoints_path=path,
            torch_dtype=torch.bfloat16,
            **settings,
        )
    )


def test_zero_points_are_held_only_with_the_setting() -> None:
    """``quantization_zero_points=True``: a checkpoint's zero points are held in the kernels'
    layout (0 past its groups, and all 0 where it has none). Unset: zero points that are all 0
    are dropped, others are refused by tensor name with the setting to change."""
    q, scale = quantize_int4(torch.randn(8, 64, generator=torch.Generator().manual_seed(0)), 32)
    key = "layers.0.mlp.up_proj.weight"
    state = {key: pack_int4(q), f"{key}_scale": scale}
    zero = torch.arange(-8, 8, dtype=torch.int8).reshape(8, 2)
    # 64 features are held as a block of 128: 4 groups of 32, the last 2 past the checkpoint's.
    expected = torch.cat([zero, torch.zeros(8, 2, dtype=torch.int8)], dim=1)

    held = fit_int4_weights(
        state | {f"{key}_zero_point": zero}, int4_config(quantization_zero_points=True)
    )
    assert torch.equal(from_kernel_scales(held[f"{key}_zero_point"]), expected)
    held = fit_int4_weights(state, int4_config(quantization_zero_points=True))
    assert torch.equal(from_kernel_scales(held[f"{key}_zero_point"]), torch.zeros_like(expected))

    fitted = fit_int4_weights(state | {f"{key}_zero_point": torch.zeros_like(zero)}, int4_config())
    assert set(fitted) == set(state)
    with pytest.raises(
        CheckpointError,
        match=rf"{key}_zero_point hold zero points other than 0 .* quantization_zero_points is "
        "not set",
    ):
        fit_int4_weights(state | {f"{key}_zero_point": zero}, int4_config())


def test_scales_are_held_in_float16(caplog) -> None:
    """The kernels hold a bfloat16 model's scales in float16: this plugin's quantizer writes
    float16 values, other tools' float32 scales are rounded with a log line saying by how much,
    and a scale float16 cannot hold is reported by tensor name. A float32 model's stay float32
    as stored."""
    q, scale = quantize_int4(torch.randn(8, 64, generator=torch.Generator().manual_seed(0)), 32)
    assert torch.equal(scale.half().float(), scale)
    state = {"layers.0.mlp.up_proj.weight": pack_int4(q)}
    fitted = fit_int4_weights(state | {"layers.0.mlp.up_proj.weight_scale": scale}, int4_config())
    assert fitted["layers.0.mlp.up_proj.weight_scale"].dtype == torch.float16
    assert "rounded to float16" not in caplog.text

    fit_int4_weights(state | {"layers.0.mlp.up_proj.weight_scale": scale * 1.0001}, int4_config())
    assert "int4 scales of /checkpoints/int4 rounded to float16" in caplog.text

    with pytest.raises(CheckpointError, match=r"up_proj.weight_scale: int4 scales .* float16"):
        fit_int4_weights(state | {"layers.0.mlp.up_proj.weight_scale": scale * 1e6}, int4_config())

    float32_config = int4_config()
    float32_config.neuron_config.torch_dtype = torch.float32
    exact = scale * 1.0001
    fitted = fit_int4_weights(state | {"layers.0.mlp.up_proj.weight_scale": exact}, float32_config)
    held = fitted["layers.0.mlp.up_proj.weight_scale"]
    assert held.dtype == torch.float32 and torch.equal(from_kernel_scales(held)[:, :2], exact)
