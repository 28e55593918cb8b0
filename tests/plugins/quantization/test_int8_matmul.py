"""The quantization plugin's int8 matmul (``plugins/quantization/int8_matmul.cpp``) against the
exact product in float64: shapes that are not multiples of the kernel's lanes and tiles, 1-8
rows, float32 and bfloat16 activations, per-row and per-tensor scales, weights using -128 (other
tools' checkpoints may), prompts (bfloat16 rows through the dequantized panels, float32 rows
through a GEMM), and the portable loop that CPUs without AVX512-VNNI take."""

from __future__ import annotations

import pytest
import torch

from nxdplug.modules.parallel_linear import ColumnParallelLinear
from nxdplug.plugins.quantization.kernel import int8_matmul_op, tile_rows, untile_rows
from nxdplug.plugins.quantization.layers import hold_quantized
from tests.fresh_process import cpu_has, run_and_load

SHAPES = [  # (rows, K, N)
    (1, 768, 1280),
    (2, 100, 37),
    (3, 1000, 3),
    (4, 100, 64),  # bfloat16, 4+ rows, K % 32 != 0: PyTorch's _weight_int8pack_mm crashes here
    (5, 64, 9),
    (8, 2048, 260),
]


def cpu_has_vnni() -> bool:
    return cpu_has("avx512bw", "avx512_vnni")


# The integer path's precision claims; on a CPU without AVX512-VNNI the op runs the portable
# loop, which the last test checks on any CPU.
needs_vnni = pytest.mark.skipif(not cpu_has_vnni(), reason="this CPU lacks AVX512-VNNI")


@pytest.fixture(scope="module")
def int8_op():
    op = int8_matmul_op()
    assert op is not None, "the int8 matmul extension did not build on this machine"
    return op


@pytest.fixture(scope="module")
def int8_matmul(int8_op):
    """The op on a weight in row order, tiled as the layers hold it."""
    return lambda x, weight, scale: int8_op(x, tile_rows(weight), scale)


@pytest.mark.parametrize(("rows", "features"), [(8, 128), (9, 130), (3, 64), (4, 10), (5, 1)])
def test_tiling_is_undone_exactly(rows, features) -> None:
    weight = torch.arange(rows * features).reshape(rows, features)
    tiled = tile_rows(weight)
    assert tiled.shape == weight.shape and torch.equal(untile_rows(tiled), weight)
    if rows >= 4 and features >= 64:  # a tile's four rows' first 64 columns come first
        assert torch.equal(tiled.flatten()[: 4 * 64].view(4, 64), weight[:4, :64])


def operands(rows: int, K: int, N: int, dtype: torch.dtype, seed: int = 0):
    """Activations spanning 4 decades (so that rounding them to integers is exercised), int8
    weights over the whole range, per-row scales."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-3, 1, K)[torch.randperm(K, generator=generator)]
    x = (torch.randn(rows, K, generator=generator) * magnitudes).to(dtype)
    weight = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=generator)
    scale = torch.rand(N, generator=generator) * 0.01 + 1e-4
    return x, weight, scale


def exact(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.double() @ weight.double().T * scale.double()


@needs_vnni
@pytest.mark.parametrize(("rows", "K", "N"), SHAPES)
def test_bfloat16_rows_give_the_exact_product_rounded_to_bfloat16(int8_matmul, rows, K, N):
    x, weight, scale = operands(rows, K, N, torch.bfloat16)
    out = int8_matmul(x, weight, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, N)
    expected = exact(x, weight, scale)
    rounded = expected.to(torch.bfloat16)
    # Each output is the exact value rounded to bfloat16 but for the rounding of the small
    # activations to integers (2^-22 of the row's largest): that moves at most one in a hundred
    # here, with activations over 4 decades, to the neighbouring bfloat16, and never further.
    assert (out != rounded).float().mean().item() <= 1e-2
    ulp = torch.finfo(torch.bfloat16).eps * expected.abs().clamp_min(1e-30)
    assert ((out.double() - expected).abs() <= ulp).all()


@needs_vnni
@pytest.mark.parametrize(("rows", "K", "N"), SHAPES)
def test_float32_rows_are_closer_to_the_exact_product_than_a_float32_matmul(
    int8_matmul, rows, K, N
):
    x, weight, scale = operands(rows, K, N, torch.float32)
    out = int8_matmul(x, weight, scale)
    expected = exact(x, weight, scale)
    float32_matmul = (x @ weight.float().T) * scale
    error = (out.double() - expected).abs().max().item()
    assert error <= (float32_matmul.double() - expected).abs().max().item()
    assert error <= 2 * torch.finfo(torch.float32).eps * expected.abs().max().item()


PROMPT_SHAPES = [  # (rows, K, N): partial panels of 32 rows, rows past the last tile of four,
    (12, 100, 70),  # K past the last lane of 64 and the last 16 pairs of a panel's transpose
    (40, 768, 1280),
    (130, 130, 33),
    (33, 2048, 96),
]


@pytest.mark.skipif(not cpu_has("avx512bw", "avx512_bf16"), reason="this CPU lacks AVX512-BF16")
@pytest.mark.parametrize(("rows", "K", "N"), PROMPT_SHAPES)
def test_bfloat16_prompts_multiply_the_weight_rounded_to_bfloat16(int8_matmul, rows, K, N):
    """From 12 bfloat16 rows the weight is dequantized a panel at a time (each value rounded to
    bfloat16 as dequantizing in PyTorch rounds it) for the bf16 panel kernel: products exact and
    sums in float32, so within one bfloat16 step (and float32 accumulation) of that product."""
    x, weight, scale = operands(rows, K, N, torch.bfloat16)
    out = int8_matmul(x, weight, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, N)
    dequantized = (weight.float() * scale[:, None]).to(torch.bfloat16)
    expected = x.double() @ dequantized.double().T
    bound = expected.abs() * 2**-8 + expected.abs().max() * 1e-6
    assert ((out.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize(("rows", "K", "N"), PROMPT_SHAPES[1:])
def test_float32_prompts_give_the_product_within_float32_accumulation(int8_matmul, rows, K, N):
    """Past 32 float32 rows the weight is dequantized for a GEMM."""
    x, weight, scale = operands(rows, K, N, torch.float32)
    expected = exact(x, weight, scale)
    error = (int8_matmul(x, weight, scale).double() - expected).abs().max().item()
    assert error <= 1e-5 * expected.abs().max().item()


@needs_vnni
def test_per_tensor_and_bfloat16_scales(int8_matmul) -> None:
    x, weight, _ = operands(2, 300, 20, torch.float32)
    per_tensor = torch.tensor([0.02])
    torch.testing.assert_close(
        int8_matmul(x, weight, per_tensor).double(),
        exact(x, weight, per_tensor.expand(20)),
        rtol=1e-6,
        atol=1e-9,
    )
    scale = torch.rand(20) + 0.5
    as_bfloat16 = scale.to(torch.bfloat16)
    torch.testing.assert_close(
        int8_matmul(x, weight, as_bfloat16).double(),
        exact(x, weight, as_bfloat16.float()),
        rtol=1e-6,
        atol=1e-9,
    )


@needs_vnni
def test_zero_rows_and_rows_far_from_one(int8_matmul) -> None:
    x, weight, scale = operands(3, 200, 8, torch.float32)
    x[0] = 0
    x[1] *= 1e30
    x[2] *= 1e-30
    out = int8_matmul(x, weight, scale)
    assert torch.equal(out[0], torch.zeros(8))
    expected = exact(x, weight, scale)
    torch.testing.assert_close(out[1:].double(), expected[1:], rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_infinities_and_nans_reach_the_output(int8_matmul, dtype) -> None:
    """Integers cannot carry them: such inputs take the plain loop, so the output has them
    where a float matmul would, instead of digits made of garbage."""
    x, weight, scale = operands(3, 130, 12, dtype)
    x[0, 5] = float("nan")
    x[1, 129] = float("inf")
    out = int8_matmul(x, weight, scale)
    expected = (x.float() @ weight.float().T) * scale
    assert torch.equal(out[:2].float().isnan(), expected[:2].isnan())
    assert torch.equal(out[:2].float().isinf(), expected[:2].isinf())
    assert out[0].isnan().all() and not out[1].isfinite().any()
    torch.testing.assert_close(out[2].float(), expected[2], rtol=1e-2, atol=1e-2)


def test_bad_operands_are_refused(int8_matmul) -> None:
    x, weight, scale = operands(1, 64, 4, torch.float32)
    with pytest.raises(RuntimeError, match="an int8 weight expected"):
        int8_matmul(x, weight.float(), scale)
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and weight \[N, K\] expected"):
        int8_matmul(x[:, :32], weight, scale)
    with pytest.raises(RuntimeError, match="scale of 4 or 1 values expected"):
        int8_matmul(x, weight, scale[:3])


PORTABLE_RUN = """
import sys
import torch
from nxdplug.plugins.quantization.kernel import int8_matmul_op, tile_rows
from tests.plugins.quantization.test_int8_matmul import SHAPES, operands
op = int8_matmul_op()
outputs = {}
for rows, K, N in [*SHAPES, (40, 130, 33)]:  # the last: float32 past 32 rows, dequantized
    for dtype in (torch.float32, torch.bfloat16):
        x, weight, scale = operands(rows, K, N, dtype)
        outputs[rows, K, N, dtype] = op(x, tile_rows(weight), scale)
torch.save(outputs, sys.argv[1])
"""


def test_the_portable_loop_gives_the_product_too(int8_matmul, tmp_path) -> None:
    """The loop of CPUs without AVX512-VNNI (and, past 32 float32 rows, their plain
    dequantization for a GEMM), forced on this one in a fresh process: within float32
    accumulation error of the exact product, and not the VNNI path's bits (which would mean
    that it did not run)."""
    outputs = run_and_load(PORTABLE_RUN, tmp_path, NXDPLUG_INT8_MATMUL_PORTABLE="1")
    differs = False
    for (rows, K, N, dtype), portable in outputs.items():
        x, weight, scale = operands(rows, K, N, dtype)
        expected = exact(x, weight, scale)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        error = (portable.double() - expected).abs().max().item()
        assert error <= tolerance * expected.abs().max().item(), (rows, K, N, dtype, error)
        differs |= not torch.equal(portable, int8_matmul(x, weight, scale))
    assert differs or not cpu_has_vnni()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 32, 33])
def test_quantized_layers_give_the_product_whichever_path_they_take(
    int8_op, monkeypatch, dtype, rows
) -> None:
    """An int8 layer gives float32 and bfloat16 rows to the int8 matmul and dequantizes its
    weight for float16 inputs: each way, the product plus bias."""
    calls = []
    monkeypatch.setattr(
        "nxdplug.plugins.quantization.layers.int8_matmul_op",
        lambda: lambda *args: calls.append(1) or int8_op(*args),
    )
    layer = hold_quantized(ColumnParallelLinear(96, 40, bias=True), torch.int8, row_scales=True)
    x, weight, scale = operands(rows, 96, 40, torch.float32)
    bias = torch.randn(40)
    layer.load_state_dict({"weight": tile_rows(weight), "weight_scale": scale, "bias": bias})
    layer.to(dtype)
    layer.weight_scale.data = scale  # float32, as in the checkpoint
    out = layer(x.to(dtype).reshape(1, rows, 96))
    assert out.dtype == dtype and out.shape == (1, rows, 40)
    assert len(calls) == (0 if dtype == torch.float16 else 1)
    expected = exact(x.to(dtype), weight, scale) + bias.to(dtype).double()
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(
        out[0].double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item()
    )
