"""Sequence parallelism over two gloo ranks: context encoding with the residual stream split
along the sequence gives HF's greedy tokens, eager and compiled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nxdplug import NeuronConfig, from_pretrained
from nxdplug.config import MoENeuronConfig
from nxdplug.errors import ConfigError
from nxdplug.testing import end_rank_process
from tests.core.modules.test_tensor_parallel import (
    assert_every_rank_generated,
    become_launched_rank,
    hf_greedy_tokens,
    spawn_two_ranks,
)
from tests.core.modules.test_tensor_parallel import generate as generate_tokens

SETTINGS = {
    "torch_dtype": "float32",
    "batch_size": 2,
    "seq_len": 48,
    "max_context_length": 16,
    "tp_degree": 2,
    "sequence_parallel_enabled": True,
}


def _rank(rank: int, world: int, port: int, checkpoint: str, work: str) -> None:
    become_launched_rank(rank, world, port)
    import torch.distributed as dist

    try:
        app = from_pretrained(checkpoint, NeuronConfig(**SETTINGS))
        app.to_cpu()
        widths = []
        layer = app.context_encoding_model.model.layers[0]
        layer.register_forward_hook(lambda _m, args, _o: widths.append(args[0].shape[1]))
        torch.save(generate_tokens(app), Path(work) / f"eager-{rank}.pt")
        (Path(work) / f"widths-{rank}.json").write_text(json.dumps(widths[:2]))
        app = from_pretrained(checkpoint, NeuronConfig(**SETTINGS))
        app.compile(Path(work) / "compiled", quiet=True)
        app.load(Path(work) / "compiled", quiet=True)
        torch.save(generate_tokens(app), Path(work) / f"compiled-{rank}.pt")
        end_rank_process()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_run(tiny_checkpoint, tmp_path_factory):
    checkpoint = tiny_checkpoint("llama", seed=11)
    work = tmp_path_factory.mktemp("sp2")
    spawn_two_ranks(_rank, str(checkpoint), str(work))
    return work, hf_greedy_tokens(checkpoint)


@pytest.mark.slow
@pytest.mark.parametrize("step", ["eager", "compiled"])
def test_every_rank_generates_hf_greedy_tokens(two_rank_run, step) -> None:
    work, expected = two_rank_run
    assert_every_rank_generated(work, step, expected)


@pytest.mark.slow
def test_context_encoding_layers_see_half_the_sequence(two_rank_run) -> None:
    """The prompt bucket (16 tokens) enters the first layer as 8 per rank; decoding, one."""
    work, _ = two_rank_run
    for rank in range(2):
        assert json.loads((work / f"widths-{rank}.json").read_text()) == [8, 1]


def test_a_model_whose_layers_cannot_split_the_sequence_is_refused(tiny_checkpoint) -> None:
    checkpoint = tiny_checkpoint("dbrx")
    settings = SETTINGS | {"tp_degree": 1, "glu_mlp": True}
    app = from_pretrained(checkpoint, MoENeuronConfig(**settings))
    with pytest.raises(ConfigError, match=r"NeuronDbrxBlock\) do not split the sequence"):
        app.to_cpu()
