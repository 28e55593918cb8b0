"""A decode step with the static cache's attention kernel against the model's own attention.

    python examples/decode_attention.py --model-path /tmp/llama-120m --compiled-model-path C \
        --batch-size 16 --prompt-length 64 --seq-len 256

Builds the model twice, with ``NXDPLUG_DECODE_ATTENTION=kernel`` (the default: the static KV
cache attends over each row's visible positions where they lie) and ``=gather`` (each row's
cache line is copied up to the bucket's width for the model's attention), compiled into
``C/kernel`` and ``C/gather`` (eager without ``--compiled-model-path``); then, ``--rounds``
times, each encodes one batch of random prompts and decodes ``--steps`` greedy steps after it,
in turns. Prints the median step of each, the ratio, and whether both decoded the same tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from nxdplug import NeuronConfig, from_pretrained

SWITCH = "NXDPLUG_DECODE_ATTENTION"
MODES = ("gather", "kernel")


def build(args: argparse.Namespace, mode: str) -> Any:
    """The model with the attention ``mode``, compiled into ``C/mode`` (or eager)."""
    os.environ[SWITCH] = mode
    config = NeuronConfig(
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        max_context_length=args.prompt_length,
        torch_dtype=args.torch_dtype,
        enable_bucketing=True,
    )
    app = from_pretrained(args.model_path, config)
    if args.compiled_model_path is None:
        app.to_cpu()
    else:
        folder = args.compiled_model_path / mode
        app.compile(folder, quiet=True)
        app.load(folder, quiet=True)
    return app


@torch.inference_mode()
def decode_steps(app: Any, args: argparse.Namespace) -> tuple[list[float], torch.Tensor]:
    """Seconds of each greedy decode step after one batch of random prompts, and the tokens."""
    generator = torch.Generator().manual_seed(0)
    high = min(30000, app.config.vocab_size)
    prompts = torch.randint(3, high, (args.batch_size, args.prompt_length), generator=generator)
    rows = torch.arange(args.batch_size)
    times, decoded = [], []
    logits = app(input_ids=prompts, attention_mask=torch.ones_like(prompts)).logits
    token = logits[:, -1].argmax(dim=-1, keepdim=True)
    for step in range(args.steps):
        position = args.prompt_length + step
        start = time.perf_counter()
        logits = app(
            input_ids=token,
            attention_mask=torch.ones(args.batch_size, position + 1, dtype=torch.long),
            position_ids=torch.full((args.batch_size, 1), position),
            seq_ids=rows,
        ).logits
        token = logits[:, -1].argmax(dim=-1, keepdim=True)
        times.append(time.perf_counter() - start)
        decoded.append(token)
    return times, torch.cat(decoded, dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--compiled-model-path", type=Path, help="without it: eager")
    parser.add_argument("--torch-dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="turns of each model")
    args = parser.parse_args()
    if args.prompt_length + args.steps > args.seq_len:
        parser.error("--prompt-length plus --steps must fit in --seq-len")
    apps = {mode: build(args, mode) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    tokens = {}
    for _ in range(args.rounds):  # in turns, so that both see the same load on the machine
        for mode in MODES:
            os.environ[SWITCH] = mode  # eager models read it at every call
            round_times, tokens[mode] = decode_steps(apps[mode], args)
            times[mode] += round_times[2:]
    medians = {mode: statistics.median(times[mode]) for mode in MODES}
    for mode in MODES:
        print(f"{mode:7s} median decode step {medians[mode] * 1000:.2f} ms")
    ratio = medians["kernel"] / medians["gather"]
    same = torch.equal(tokens["gather"], tokens["kernel"])
    print(f"kernel / gather: x{ratio:.2f}; same greedy tokens: {same}")


if __name__ == "__main__":
    main()
