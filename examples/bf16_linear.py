"""The linears of one forward pass of a Llama: oneDNN's prepacked bf16 weights against panels.

    python examples/bf16_linear.py --rows 1 16 64

Makes the weights of ``--layers`` Llama layers (Q/K/V stacked, O, gate/up stacked, down) and the
output projection, by default those of docs/benchmarks.md's ~120M Llama, distinct tensors as in
a model so that every pass reads them from memory; then for each ``--rows`` (16: a 16-row decode
step, 64: a 64-token prompt) times a pass through all of them with oneDNN's linear on weights
prepacked for it (what compiled graphs run without the panel kernel,
``NXDPLUG_BF16_LINEAR=onednn``) and with ``nxdplug_bf16_linear::linear`` on the same weights in
panels, in turns, ``--passes`` times each. Prints the median pass of each, its GFLOP/s and the
ratio. Needs an x86 CPU with AVX512-BF16.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from nxdplug.plugins.inductor_backend import bf16_linear
from nxdplug.plugins.inductor_backend.prepacked_linear import prepack


def llama_weights(args: argparse.Namespace) -> list[torch.Tensor]:
    """The [out, in] weights a forward pass multiplies by, in order."""
    head_dim = args.hidden_size // args.heads
    kv = args.kv_heads * head_dim
    layer = [
        (args.hidden_size + 2 * kv, args.hidden_size),
        (args.hidden_size, args.hidden_size),
        (2 * args.intermediate_size, args.hidden_size),
        (args.hidden_size, args.intermediate_size),
    ]
    shapes = layer * args.layers + [(args.vocab_size, args.hidden_size)]
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(s, generator=generator) * 0.02).bfloat16() for s in shapes]


def one_pass(linear: Callable, inputs: list[torch.Tensor], weights: list) -> Callable[[], None]:
    def run() -> None:
        for x, weight in zip(inputs, weights, strict=True):
            linear(x, weight)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--intermediate-size", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--passes", type=int, default=20)
    args = parser.parse_args()
    if not bf16_linear.panels_in_use():
        sys.exit("the panel kernel is not usable here (an x86 CPU with AVX512-BF16 is needed)")
    panel_linear = bf16_linear.bf16_linear_op()
    weights = llama_weights(args)
    prepacked = [prepack(w) for w in weights]
    panels = [bf16_linear.to_panels(w) for w in weights]

    def onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")

    def panel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return panel_linear(x, weight, None)

    for rows in args.rows:
        inputs = [torch.randn(rows, w.shape[1]).bfloat16() for w in weights]
        flops = sum(2 * rows * w.numel() for w in weights)
        runs = {
            "oneDNN": one_pass(onednn, inputs, prepacked),
            "panels": one_pass(panel, inputs, panels),
        }
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        for run in runs.values():
            run()  # warm-up
        for _ in range(args.passes):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(times) for name, times in seconds.items()}
        cells = [
            f"{name} {median * 1e3:.2f} ms ({flops / median / 1e9:.0f} GFLOP/s)"
            for name, median in medians.items()
        ]
        ratio = medians["oneDNN"] / medians["panels"]
        print(f"{rows:4d} rows: " + ", ".join(cells) + f"; panels x{ratio:.2f} faster")


if __name__ == "__main__":
    main()
