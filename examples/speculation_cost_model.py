"""Where speculation breaks even on this machine: per-call times of targets of growing size.

A speculating step costs a verification (k + 1 new tokens over the cache) plus what proposing
costs, and yields the tokens a verification keeps; a plain step costs one decode call and
yields one token. So a method pays on a target of size S when

    tokens_per_verification * decode(S) > verify(S, k) + propose(S, k)

This script measures ``decode`` and ``verify`` (the compiled graphs' ``app.run`` calls, batch
1, ``--cached`` positions in the cache, medians) on Llama-shaped targets of random weights,
and what proposing costs per method:

- ``ngram``: the engine's lookup in the request's tokens (host work);
- ``draft_model``: k decode calls of the draft (``--draft``, the shipped pycoder-draft);
- ``eagle``: k calls of an EAGLE head for that target, timed as the decode call of a one-layer
  Llama of the target's width and vocabulary (what an EAGLE-1 head computes, less its ``fc``).

Tokens per verification are not measured here: they depend on the draft and the text, not on
the target's speed. The defaults are the engine's figures on pycoder-tiny
(docs/speculative-decoding.md), and the break-even assumes a target of each size that a draft
predicts as well; give your own with ``--tokens-per-verification``.

    python examples/speculation_cost_model.py --work-dir /tmp/cost-model
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from pathlib import Path

import torch

from nxdplug import NeuronConfig, from_pretrained
from nxdplug.plugin_api import ScheduledStep
from nxdplug.testing.tiny_models import make_tiny_checkpoint

REPO = Path(__file__).resolve().parent.parent
DRAFT = REPO / "examples" / "models" / "pycoder-draft"
# Llama shapes: pycoder-tiny's, the README's ~120M, a ~400M, and Llama-3.2-1B's.
SHAPES = {
    "pycoder-tiny": dict(
        hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=688, vocab_size=2048,
    ),
    "120m": dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
        intermediate_size=2048, vocab_size=32000,
    ),
    "400m": dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8,
        intermediate_size=2816, vocab_size=32000,
    ),
    "1b": dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
    ),
}  # fmt: skip
# Tokens a k=4 verification kept in the engine on pycoder-tiny (docs/speculative-decoding.md).
TOKENS_PER_VERIFICATION = {"ngram": 3.03, "draft_model": 2.45, "eagle": 2.65}


def make_checkpoint(folder: Path, shape: dict) -> Path:
    """A random Llama of ``shape`` (made once)."""
    if not (folder / "config.json").exists():
        make_tiny_checkpoint("llama", folder, overrides=shape | {"initializer_range": 0.02})
    return folder


def loaded(path: Path, folder: Path, eager: bool, **settings) -> object:
    """The application of ``path``, bf16, batch 1, compiled into ``folder`` once."""
    config = NeuronConfig(
        torch_dtype="bfloat16",
        batch_size=1,
        max_context_length=64,
        seq_len=512,
        compile_backend="eager" if eager else "inductor",
        **settings,
    )
    app = from_pretrained(path, config)
    if eager:
        app.to_cpu()
        return app
    if not folder.exists():
        app.compile(folder, quiet=True)
        app = from_pretrained(path, config)
    app.load(folder, quiet=True)
    return app


def call_time(app: object, width: int, cached: int, calls: int) -> float:
    """Median seconds of ``app.run`` adding ``width`` tokens over ``cached`` positions."""
    tokens = torch.ones(1, width, dtype=torch.long)
    step = ScheduledStep.next_tokens(tokens, torch.tensor([cached]))
    times = []
    with torch.inference_mode():
        app.run(step)
        for _ in range(calls):
            start = time.perf_counter()
            app.run(step)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def ngram_time(k: int, cached: int, calls: int) -> float:
    """Median seconds of the engine's n-gram lookup (n 4 down to 2) in a request of ``cached``
    tokens whose last 2-gram occurred halfway through."""
    from nxdplug.plugins.draft_speculation.engine_proposers import NgramProposer

    proposer = NgramProposer(2, 4)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (cached,), generator=generator).tolist()
    tokens[-2:] = tokens[cached // 2 : cached // 2 + 2]
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        proposer.lookup(tokens, k)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def break_even(sizes: list[tuple[float, float]]) -> str:
    """The smallest size (parameters) from which a method pays, interpolated log-linearly
    between measured sizes; ``sizes``: (parameters, speed-up), by size."""
    for (low, low_gain), (high, high_gain) in itertools.pairwise(sizes):
        if low_gain < 1 <= high_gain:
            share = (1 - low_gain) / (high_gain - low_gain)
            return f"~{low * (high / low) ** share / 1e6:.0f}M"
    if sizes[0][1] >= 1:
        return f"already at {sizes[0][0] / 1e6:.1f}M"
    return f"not by {sizes[-1][0] / 1e6:.0f}M"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--sizes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--cached", type=int, default=200)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--eager", action="store_true", help="skip compiling (a quick check)")
    parser.add_argument(
        "--tokens-per-verification",
        type=json.loads,
        default=TOKENS_PER_VERIFICATION,
        help="JSON object: method -> tokens a verification keeps",
    )
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    k, cached, calls = args.k, args.cached, args.calls
    mode = "eager" if args.eager else "compiled"
    draft = loaded(DRAFT, args.work_dir / f"draft-{mode}", args.eager)
    draft_call = call_time(draft, 1, cached, calls)
    print(f"pycoder-draft decode call: {draft_call * 1e3:.2f} ms")
    gains: dict[str, list[tuple[float, float]]] = {m: [] for m in args.tokens_per_verification}
    rows = []
    for name in args.sizes:
        shape = SHAPES[name]
        path = make_checkpoint(args.work_dir / name, shape)
        target = loaded(path, args.work_dir / f"{name}-{mode}", args.eager, speculation_length=k)
        parameters = checkpoint_parameters(path)
        decode, verify = (
            call_time(target, 1, cached, calls),
            call_time(target, k + 1, cached, calls),
        )
        head_shape = shape | {"num_hidden_layers": 1}
        head_path = make_checkpoint(args.work_dir / f"{name}-head", head_shape)
        head = loaded(head_path, args.work_dir / f"{name}-head-{mode}", args.eager)
        propose = {
            "ngram": ngram_time(k, cached, calls),
            "draft_model": k * draft_call,
            "eagle": k * call_time(head, 1, cached, calls),
        }
        row = [name, f"{parameters / 1e6:.0f}M", f"{decode * 1e3:.2f}", f"{verify / decode:.2f}"]
        for method, tokens in args.tokens_per_verification.items():
            gain = tokens * decode / (verify + propose[method])
            gains[method].append((parameters, gain))
            row.append(f"{propose[method] / decode:.2f} / x{gain:.2f}")
        rows.append(row)
        del target, head
    methods = list(args.tokens_per_verification)
    print(f"\nk={k}, {cached} positions cached, batch 1, bf16 {mode}, medians of {calls} calls")
    header = ["target", "params", "decode ms", "verify / decode"]
    header += [
        f"{m} ({args.tokens_per_verification[m]} tok/verif.): propose/decode, speed-up"
        for m in methods
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for method in methods:
        print(f"{method}: breaks even {break_even(gains[method])}")


def checkpoint_parameters(path: Path) -> int:
    """The parameters a checkpoint stores."""
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as tensors:
        names = tensors.keys()
        return sum(math.prod(tensors.get_slice(name).get_shape()) for name in names)


if __name__ == "__main__":
    main()
