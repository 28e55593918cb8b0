"""The serving engine's throughput with no server: what `nxdplug serve` can reach at most.

    python examples/engine_throughput.py --model-path /tmp/llama-120m-fullvocab \
        --compiled-model-path C --batch-size 16 --requests 64 \
        --context-encoding-buckets 64 128 --token-generation-buckets 128 256

Runs the load `nxdplug benchmark-serving` sends (``--concurrency`` requests at a time, each
followed by the next as it ends, greedy, no end-of-sequence stop) through ``Engine.step()`` in
this process, with the server's defaults (continuous batching, prompts encoded one at a time,
buckets), and prints output tokens a second and the median step. The difference from
`benchmark-serving`'s figure is what HTTP and the clients cost.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

import torch

from nxdplug import NeuronConfig, from_pretrained
from nxdplug.cli.options import parse_key_value
from nxdplug.engine import Engine, SamplingSettings
from nxdplug.plugins.serve.cli import SERVE_DEFAULTS


def build(args: argparse.Namespace) -> Engine:
    settings = SERVE_DEFAULTS | {
        "torch_dtype": args.torch_dtype,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "max_context_length": args.max_context_length,
    }
    if args.context_encoding_buckets:
        settings["context_encoding_buckets"] = args.context_encoding_buckets
    if args.token_generation_buckets:
        settings["token_generation_buckets"] = args.token_generation_buckets
    settings |= dict(args.neuron_config or ())
    app = from_pretrained(args.model_path, NeuronConfig(**settings))
    if args.compiled_model_path is None:
        app.to_cpu()
    else:
        app.compile(args.compiled_model_path, quiet=True)
        app.load(args.compiled_model_path, quiet=True)
    return Engine(app, eos_token_ids=[])


def serve_closed_loop(
    engine: Engine, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> tuple[float, list[float]]:
    """Serve ``prompts``, ``concurrency`` at a time; the duration and each step's time."""
    waiting = iter(prompts)
    settings = SamplingSettings(max_tokens, temperature=0)
    for prompt in itertools.islice(waiting, concurrency):
        engine.add_request(prompt, settings)
    steps = []
    start = time.perf_counter()
    while engine.has_unfinished():
        step_start = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - step_start)
        ended = sum(output.finished for output in outputs)
        for prompt in itertools.islice(waiting, ended):
            engine.add_request(prompt, settings)
    return time.perf_counter() - start, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--compiled-model-path", type=Path, help="without it: eager")
    parser.add_argument("--torch-dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=16, help="cache lines")
    parser.add_argument("--concurrency", type=int, help="requests at a time (the batch size)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--max-context-length", type=int, default=128)
    parser.add_argument("--context-encoding-buckets", type=int, nargs="+", metavar="N")
    parser.add_argument("--token-generation-buckets", type=int, nargs="+", metavar="N")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument(
        "--neuron-config",
        action="append",
        type=parse_key_value,
        metavar="KEY=VALUE",
        help="another NeuronConfig setting (repeatable), e.g. is_block_kv_layout=true",
    )
    args = parser.parse_args()
    concurrency = args.concurrency or args.batch_size
    engine = build(args)
    generator = torch.Generator().manual_seed(0)
    high = min(30000, engine.vocab_size)
    prompts = [
        torch.randint(3, high, (args.prompt_length,), generator=generator).tolist()
        for _ in range(args.requests)
    ]
    serve_closed_loop(engine, prompts[:concurrency], concurrency, 4)  # warm-up
    tokens = args.requests * args.max_tokens
    for _ in range(args.runs):
        seconds, steps = serve_closed_loop(engine, prompts, concurrency, args.max_tokens)
        print(
            f"{args.requests} requests, {concurrency} at a time: {seconds:.2f} s, "
            f"{tokens / seconds:.1f} output tok/s, {len(steps)} steps, "
            f"median step {statistics.median(steps) * 1000:.2f} ms"
        )


if __name__ == "__main__":
    main()
