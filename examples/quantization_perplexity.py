"""Held-out perplexity of a model with each weight-quantization method, against its float32 self.

The held-out text is pycoder-tiny's (``../shared/models/heldout_files.txt``: standard-library
files, read from this Python's own library); the files' token ids are joined and cut into
windows of 256 predicted tokens, as ``../shared/models/README.md`` measures it (pycoder-tiny:
perplexity 13.85 in float32). Each method quantizes the checkpoint with
``save_quantized_state_dict`` into a temporary folder; every model scores the windows through
``forward(prompt_logprobs=True)`` in float32.

    python examples/quantization_perplexity.py --model-path ../shared/models/pycoder-tiny \\
        --heldout ../shared/models/heldout_files.txt
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer

from nxdplug import NeuronConfig, from_pretrained

WINDOW = 256  # predicted tokens per window
BATCH = 8
METHODS = {
    "float32": None,
    "int8 per channel": ("int8", "per_channel_symmetric", None),
    "int4 blocks of 128": ("int4", "blockwise_symmetric", 128),
    "int4 blocks of 32": ("int4", "blockwise_symmetric", 32),
    "int4 per channel": ("int4", "per_channel_symmetric", None),
}


def heldout_tokens(model_path: str, heldout: Path, library: Path) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids: list[int] = []
    for name in heldout.read_text().split():
        text = (library / name).read_text(encoding="utf-8")
        ids += tokenizer(text, add_special_tokens=False, verbose=False).input_ids
    return torch.tensor(ids)


def windows(tokens: torch.Tensor) -> torch.Tensor:
    """[n, WINDOW + 1]: consecutive windows overlapping by one token."""
    count = (len(tokens) - 1) // WINDOW
    return torch.stack([tokens[i * WINDOW : (i + 1) * WINDOW + 1] for i in range(count)])


def options(method: tuple | None, folder: Path) -> dict:
    if method is None:
        return {}
    dtype, granularity, block = method
    settings = {
        "quantized": True,
        "quantized_checkpoints_path": str(folder),
        "quantization_dtype": dtype,
        "quantization_type": granularity,
    }
    return settings | ({"quantization_block_size": block} if block else {})


def perplexity(model_path: str, settings: dict, rows: torch.Tensor) -> float:
    neuron_config = NeuronConfig(
        batch_size=BATCH,
        seq_len=WINDOW + 1,
        max_context_length=WINDOW + 1,
        torch_dtype="float32",
        enable_prompt_logprobs=True,
        **settings,
    )
    app = from_pretrained(model_path, neuron_config)
    if settings:
        type(app).save_quantized_state_dict(model_path, app.config)
    app.to_cpu()
    total, count = 0.0, 0
    for start in range(0, len(rows), BATCH):
        batch = rows[start : start + BATCH]
        app.reset()
        out = app(input_ids=batch, attention_mask=torch.ones_like(batch), prompt_logprobs=True)
        logprobs = out.prompt_logprobs[:, 1 : WINDOW + 1]
        total += float(logprobs.double().sum())
        count += logprobs.numel()
    return math.exp(-total / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--heldout", type=Path, required=True, help="held-out file list")
    parser.add_argument(
        "--library",
        type=Path,
        default=Path(sysconfig.get_paths()["stdlib"]),
        help="the folder the listed files are in (default: this Python's standard library)",
    )
    args = parser.parse_args()
    rows = windows(heldout_tokens(args.model_path, args.heldout, args.library))
    print(f"{len(rows)} windows, {len(rows) * WINDOW} predicted tokens")
    baseline = None
    with tempfile.TemporaryDirectory() as scratch:
        for name, method in METHODS.items():
            value = perplexity(args.model_path, options(method, Path(scratch) / name), rows)
            baseline = baseline or value
            print(f"{name:20s} perplexity {value:8.3f}  x{value / baseline:.4f} of float32's")


if __name__ == "__main__":
    main()
