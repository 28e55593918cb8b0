"""Whether int4 or bf16 projections are bound by memory or by arithmetic, by the rows of x.

    python examples/int4_rows_bound.py --rows 1 8 16

For each ``--rows``, times the projections of a ~120M Llama's 12 layers (Q/K/V and gate/up
stacked, as compiled graphs run them) two ways, in turns: the bf16 panel kernel
(``nxdplug_bf16_linear::linear``) and the int4 kernel (groups of 32, the plugin's own layout).
"Streamed" uses distinct weights, read from memory as in a decode step; "hot" multiplies by one
512 x 768 weight as many times, which stays in the L2 cache. A kernel whose streamed time is its
hot time (per multiply-add) is bound by its arithmetic, not by memory. Prints medians and GMAC/s.
Needs an x86 CPU with AVX512-BF16 (for the panel kernel).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from nxdplug.plugins.inductor_backend.bf16_linear import bf16_linear_op, to_panels
from nxdplug.plugins.quantization.int4 import (
    int4_kernels,
    kernel_scales,
    padded_features,
    quantize_int4,
    to_kernel_layout,
)

GROUP = 32
LAYER = [(1280, 768), (768, 768), (4096, 768), (768, 2048)]  # [out, in] of one layer


def median_ms(run: Callable[..., None], passes: int, *arguments: object) -> float:
    for _ in range(3):
        run(*arguments)
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        run(*arguments)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


Weights = list[tuple[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor], int]]


def int4_pass(kernels: object, x: dict[int, torch.Tensor], weights: Weights) -> None:
    for ((packed, scales), _), k in weights:
        kernels.int4_matmul(x[k], packed, scales, None, GROUP)


def bf16_pass(x: dict[int, torch.Tensor], weights: Weights) -> None:
    for (_, panels), k in weights:
        torch.ops.nxdplug_bf16_linear.linear(x[k], panels, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--passes", type=int, default=15)
    args = parser.parse_args()
    kernels = int4_kernels()
    bf16_linear_op()
    torch.manual_seed(0)

    def formats(shape: tuple[int, int]) -> tuple[tuple, torch.Tensor]:
        weight = torch.randn(*shape) * 0.02
        quantized, scales = quantize_int4(weight, GROUP)
        padded = padded_features(shape[1])
        int4 = (to_kernel_layout(quantized, padded), kernel_scales(scales, GROUP, GROUP, padded))
        return int4, to_panels(weight.bfloat16())

    streamed_shapes = LAYER * args.layers
    hot_shape = (512, 768)
    macs_per_row = sum(n * k for n, k in streamed_shapes)
    hot_calls = macs_per_row // (hot_shape[0] * hot_shape[1])
    hot = formats(hot_shape)
    cases = {
        "streamed": [(formats(shape), shape[1]) for shape in streamed_shapes],
        "hot": [(hot, hot_shape[1])] * hot_calls,
    }
    for rows in args.rows:
        x = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in LAYER}}
        for name, weights in cases.items():
            macs = rows * sum(packed.shape[0] * k for ((packed, _), _), k in weights)
            bf16_ms = median_ms(bf16_pass, args.passes, x, weights)
            int4_ms = median_ms(int4_pass, args.passes, kernels, x, weights)
            print(
                f"{rows:3d} rows, {name:8s}: bf16 {bf16_ms:6.2f} ms {macs / bf16_ms / 1e6:6.1f} "
                f"GMAC/s; int4 {int4_ms:6.2f} ms {macs / int4_ms / 1e6:6.1f} GMAC/s; "
                f"int4 / bf16 {int4_ms / bf16_ms:.2f}"
            )


if __name__ == "__main__":
    main()
