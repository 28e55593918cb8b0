"""Time the serving engine with and without async mode, in one run, on one model.

    python examples/engine_async_mode.py --model-path /tmp/llama-120m --compiled-model-path C

Serves the same requests (greedy, on-device sampling, text decoded as it comes) in turns with
``async_mode`` off and on, and prints the median time of a decode step of each and the gain.
Both load the same compiled folder (async mode is a runtime setting), or run eagerly without
``--compiled-model-path``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from nxdplug import NeuronConfig, OnDeviceSamplingConfig, from_pretrained
from nxdplug.engine import Engine, SamplingSettings


def build(args: argparse.Namespace, async_mode: bool) -> Engine:
    config = NeuronConfig(
        torch_dtype=args.torch_dtype,
        is_continuous_batching=True,
        batch_size=args.batch_size,
        seq_len=args.prompt_length + args.max_tokens,
        max_context_length=args.prompt_length,
        on_device_sampling_config=OnDeviceSamplingConfig(dynamic=True),
        async_mode=async_mode,
    )
    app = from_pretrained(args.model_path, config)
    if args.compiled_model_path is None:
        app.to_cpu()
    else:
        app.compile(args.compiled_model_path, quiet=True)
        app.load(args.compiled_model_path, quiet=True)
    return Engine(app, AutoTokenizer.from_pretrained(args.model_path), eos_token_ids=[])


def decode_step_seconds(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """Serve every prompt at once; the duration of each step after the prompts are encoded."""
    for prompt in prompts:
        engine.add_request(prompt, SamplingSettings(max_tokens, 0))
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[2:]  # the first steps encode prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--compiled-model-path", type=Path, help="without it: eager")
    parser.add_argument("--torch-dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    engines = {False: build(args, False), True: build(args, True)}
    vocab = engines[False].vocab_size
    prompts = [
        torch.randint(3, min(20000, vocab), (args.prompt_length,), generator=generator).tolist()
        for _ in range(args.batch_size)
    ]
    for engine in engines.values():
        decode_step_seconds(engine, prompts, 4)  # warm-up
    steps: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.runs):
        for async_mode, engine in engines.items():
            steps[async_mode] += decode_step_seconds(engine, prompts, args.max_tokens)
    off, on = (statistics.median(steps[mode]) * 1000 for mode in (False, True))
    print(f"batch {args.batch_size}, {args.torch_dtype}, median decode step of the engine:")
    print(f"  async_mode=False {off:.2f} ms   async_mode=True {on:.2f} ms   gain {off / on:.2f}x")


if __name__ == "__main__":
    main()
