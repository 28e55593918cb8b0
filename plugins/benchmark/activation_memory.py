"""Activation memory of one context encoding: tensor parallelism alone against sequence
parallelism added, per rank, and one process as a reference.

``python -m nxdplug.plugins.benchmark.activation_memory --model-path P --prompt-length N`` runs
one eager context-encoding step of an ``N``-token prompt (batch 1) in this process, then starts
``--tp-degree`` gloo ranks that each run the same step with tensor parallelism alone and then
with ``sequence_parallel_enabled``, and prints the peak bytes of the tensors each step created.

:class:`ActivationMemoryTracker` counts what PyTorch's operators allocate while a block runs:
every operator output whose storage is new (neither an input's nor one already counted) adds its
storage's bytes once, and the storage's release takes them away again. The peak is the most that
was alive at once, above what existed before the block: weights, the KV cache and other tensors
created earlier are not counted, nor written in place. Not counted either: memory an operator
uses inside its kernel and frees before returning (the fused attention kernel's per-thread
buffers), the buffers of the collectives' transport (gloo's), the allocator's slack, and memory
outside PyTorch's tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nxdplug.plugin_api import (
    NeuronConfig,
    NxdPlugError,
    StepInputs,
    end_rank_process,
    from_pretrained,
)

MIB = 2**20


class ActivationMemoryTracker(TorchDispatchMode):
    """While active (``with ActivationMemoryTracker() as tracker:``), the bytes of the tensor
    storages the block's operators created and that are still alive (``live_bytes``), and the
    most that were alive at once (``peak_bytes``); both start at 0."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._counted: set[int] = set()  # data pointers of the live storages counted

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        outputs = func(*args, **(kwargs or {}))
        inputs = {storage.data_ptr() for storage in _storages(tree_leaves((args, kwargs)))}
        for storage in _storages(tree_leaves(outputs)):
            self._count_if_new(storage, inputs)
        return outputs

    def _count_if_new(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        pointer, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or pointer in inputs or pointer in self._counted:
            return
        self._counted.add(pointer)
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._release, pointer, size)

    def _release(self, pointer: int, size: int) -> None:
        self._counted.discard(pointer)
        self.live_bytes -= size


def _storages(leaves: list[Any]) -> Iterator[torch.UntypedStorage]:
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            yield leaf.untyped_storage()


@attrs.frozen
class Measurement:
    """Settings of one measurement: the checkpoint, the prompt, the ranks to launch, the dtype."""

    model_path: str
    prompt_length: int
    tp_degree: int
    torch_dtype: str


# Encodings measured per setting, the least peak kept: with two ranks, a collective's buffer is
# now and then freed a moment late (seen: one run in ~12 counted 32 KiB more, one activation of
# the tiny test model), which only ever adds to a peak.
RUNS = 3


def context_encoding_peak(measurement: Measurement, tp_degree: int, sequence_parallel: bool) -> int:
    """Peak bytes of the tensors one eager context encoding of the prompt creates, in this
    process (one rank of ``tp_degree`` when launched as such): the least of RUNS encodings."""
    length = measurement.prompt_length
    config = NeuronConfig(
        torch_dtype=measurement.torch_dtype,
        batch_size=1,
        seq_len=length,
        max_context_length=length,
        tp_degree=tp_degree,
        sequence_parallel_enabled=sequence_parallel,
    )
    app = from_pretrained(measurement.model_path, config)
    app.to_cpu()
    positions = torch.arange(length)[None]
    step = StepInputs(
        input_ids=positions % app.config.vocab_size,
        attention_mask=torch.ones(1, length, dtype=torch.long),
        position_ids=positions,
        seq_ids=torch.zeros(1, dtype=torch.long),
    )
    peaks = []
    for _ in range(RUNS):
        with torch.no_grad(), ActivationMemoryTracker() as tracker:
            app.context_encoding_model(step)
        peaks.append(tracker.peak_bytes)
    return min(peaks)


def _rank(rank: int, measurement: Measurement, port: int, results: str) -> None:
    """One launched rank: TP alone, then TP with SP; the peaks go to ``results``/rank.json."""
    os.environ |= {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(measurement.tp_degree),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
    }
    torch.set_num_threads(1)
    try:
        peaks = {
            mode: context_encoding_peak(measurement, measurement.tp_degree, sequence_parallel)
            for mode, sequence_parallel in (("tp", False), ("tp+sp", True))
        }
    except NxdPlugError as exc:
        (Path(results) / f"error-{rank}.txt").write_text(str(exc))
        if dist.is_initialized():
            dist.destroy_process_group()
        os._exit(1)
    (Path(results) / f"{rank}.json").write_text(json.dumps(peaks))
    end_rank_process()


def rank_peaks(measurement: Measurement) -> list[dict[str, int]]:
    """Per launched rank, the peak bytes of TP alone (``tp``) and with SP (``tp+sp``)."""
    with tempfile.TemporaryDirectory(prefix="nxdplug-activations-") as results:
        try:
            mp.spawn(
                _rank,
                args=(measurement, _free_port(), results),
                nprocs=measurement.tp_degree,
                join=True,
            )
        except mp.ProcessExitedException:
            errors = sorted(Path(results).glob("error-*.txt"))
            if not errors:
                raise
            raise NxdPlugError(errors[0].read_text()) from None
        return [
            json.loads((Path(results) / f"{rank}.json").read_text())
            for rank in range(measurement.tp_degree)
        ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(measurement: Measurement, single: int, ranks: list[dict[str, int]]) -> str:
    """The table the command prints: MiB per rank, and SP's peak as a fraction of TP's."""
    lines = [
        f"peak activation memory of one context encoding: {measurement.prompt_length} tokens, "
        f"batch 1, {measurement.torch_dtype}, eager",
        f"one process: {single / MIB:.1f} MiB",
        "rank | TP alone (MiB) | TP + SP (MiB) | TP + SP / TP alone",
    ]
    for rank, peaks in enumerate(ranks):
        tp, sp = peaks["tp"], peaks["tp+sp"]
        lines.append(f"{rank} | {tp / MIB:.1f} | {sp / MIB:.1f} | {sp / tp:.3f}")
    return "\n".join(lines)


def check(measurement: Measurement) -> list[str]:
    """What is wrong with the settings, before any process starts."""
    problems = []
    if not (Path(measurement.model_path) / "config.json").is_file():
        problems.append(f"--model-path {measurement.model_path}: no config.json there")
    if measurement.tp_degree < 2:
        problems.append(f"--tp-degree must be 2 or more (got {measurement.tp_degree})")
    if measurement.prompt_length < 2:
        problems.append(f"--prompt-length must be 2 or more (got {measurement.prompt_length})")
    elif measurement.tp_degree >= 2 and measurement.prompt_length % measurement.tp_degree:
        problems.append(
            f"--prompt-length {measurement.prompt_length} does not split over "
            f"{measurement.tp_degree} ranks: sequence parallelism needs a multiple of --tp-degree"
        )
    return problems


def parse(argv: list[str] | None) -> Measurement:
    parser = argparse.ArgumentParser(
        prog="python -m nxdplug.plugins.benchmark.activation_memory",
        description="Peak activation memory of one context encoding per rank: tensor "
        "parallelism alone against sequence parallelism added, and one process.",
    )
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--prompt-length", type=int, required=True)
    parser.add_argument("--tp-degree", type=int, default=2)
    parser.add_argument("--torch-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    return Measurement(args.model_path, args.prompt_length, args.tp_degree, args.torch_dtype)


def main(argv: list[str] | None = None) -> int:
    measurement = parse(argv)
    problems = check(measurement)
    try:
        if problems:
            raise NxdPlugError("; ".join(problems))
        single = context_encoding_peak(measurement, tp_degree=1, sequence_parallel=False)
        ranks = rank_peaks(measurement)
    except NxdPlugError as exc:
        print(f"activation_memory: error: {exc}", file=sys.stderr)
        return 2
    print(report(measurement, single, ranks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
