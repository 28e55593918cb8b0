"""tp_degree=2 run as two processes (one rank each, gloo), eager and compiled, against HF.

The ranks are started the way torchrun starts them (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK
in the environment); the application joins their process group itself.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained
from nxdplug.compile.artefacts import ArtefactError, Manifest
from nxdplug.errors import ConfigError
from nxdplug.modules.tensor_parallel import join_launched_ranks
from nxdplug.testing import end_rank_process, hf_greedy

pytestmark = pytest.mark.slow

SETTINGS = {
    "torch_dtype": "float32",
    "batch_size": 2,
    "seq_len": 48,
    "max_context_length": 16,
    "tp_degree": 2,
    "fused_qkv": True,  # the fused projection is split Q, K and V apart
}
PROMPTS = torch.tensor([[0, 0, 5, 17, 42, 9], [8, 250, 31, 99, 7, 3]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
NEW_TOKENS = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate(app) -> torch.Tensor:
    adapter = HuggingFaceGenerationAdapter(app)
    return adapter.generate(
        PROMPTS, attention_mask=MASK, max_new_tokens=NEW_TOKENS, eos_token_id=None
    )


def become_launched_rank(rank: int, world: int, port: int) -> None:
    """The environment torchrun gives rank ``rank`` of ``world`` (one thread each)."""
    os.environ |= {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
    }
    torch.set_num_threads(1)


def _rank(rank: int, world: int, port: int, checkpoint: str, compiled: str, out: str, step: str):
    become_launched_rank(rank, world, port)
    import torch.distributed as dist

    try:
        if step == "eager-and-compile":
            app = from_pretrained(checkpoint, NeuronConfig(**SETTINGS))
            app.to_cpu()
            torch.save(generate(app), Path(out) / f"eager-{rank}.pt")
            app = from_pretrained(checkpoint, NeuronConfig(**SETTINGS))
            app.compile(compiled, quiet=True)
        app = from_pretrained(checkpoint, NeuronConfig(**SETTINGS))
        app.load(compiled, quiet=True)
        torch.save(generate(app), Path(out) / f"{step}-{rank}.pt")
        end_rank_process()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_two_ranks(rank_fn, *args: str) -> None:
    """Run ``rank_fn(rank, 2, port, *args)`` in two processes launched as ranks 0 and 1."""
    mp.spawn(rank_fn, args=(2, free_port(), *args), nprocs=2, join=True)


def hf_greedy_tokens(checkpoint) -> torch.Tensor:
    """HF transformers' float32 greedy tokens for PROMPTS, the ranks' expected output."""
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return hf_greedy(hf, PROMPTS, MASK, NEW_TOKENS).sequences


def assert_every_rank_generated(work: Path, name: str, expected: torch.Tensor) -> None:
    """Both ranks saved ``{name}-{rank}.pt`` equal to ``expected``, a greedy path that varies."""
    assert len(set(expected[:, PROMPTS.shape[1] :].flatten().tolist())) > 3  # not one token
    for rank in range(2):
        assert torch.equal(torch.load(work / f"{name}-{rank}.pt"), expected), (name, rank)


def run_ranks(*args: str) -> None:
    spawn_two_ranks(_rank, *args)


@pytest.fixture(scope="module")
def two_rank_run(tiny_checkpoint, tmp_path_factory):
    """Two ranks: eager generation, compile, load; then two fresh ranks load the folder."""
    checkpoint = tiny_checkpoint("llama", seed=11)
    work = tmp_path_factory.mktemp("tp2")
    compiled = work / "compiled"
    run_ranks(str(checkpoint), str(compiled), str(work), "eager-and-compile")
    run_ranks(str(checkpoint), str(compiled), str(work), "fresh-load")
    expected = hf_greedy_tokens(checkpoint)
    return checkpoint, compiled, work, expected


@pytest.mark.parametrize("step", ["eager", "eager-and-compile", "fresh-load"])
def test_every_rank_generates_hf_greedy_tokens(two_rank_run, step: str) -> None:
    _, _, work, expected = two_rank_run
    assert_every_rank_generated(work, step, expected)


def test_folder_holds_each_ranks_graphs_and_weight_shards(two_rank_run) -> None:
    checkpoint, compiled, _, _ = two_rank_run
    manifest = Manifest.read(compiled)
    assert manifest.ranks == 2
    assert {(g.tag, g.rank) for g in manifest.graphs} == {
        (tag, rank)
        for tag in ("context_encoding_model", "token_generation_model")
        for rank in range(2)
    }
    assert manifest.weights == ("weights/rank0.safetensors", "weights/rank1.safetensors")

    full = load_file(checkpoint / "model.safetensors")
    shards = [load_file(compiled / f"weights/rank{r}.safetensors") for r in range(2)]
    gate = "layers.0.mlp.gate_proj.weight"  # column parallel: rows split
    assert torch.equal(torch.cat([s[gate] for s in shards]), full[f"model.{gate}"])
    down = "layers.0.mlp.down_proj.weight"  # row parallel: columns split
    assert torch.equal(torch.cat([s[down] for s in shards], dim=1), full[f"model.{down}"])
    qkv = torch.cat([s["layers.0.self_attn.qkv_proj.weight"] for s in shards])
    q, k, v = (full[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    halves = [t.chunk(2) for t in (q, k, v)]  # rank 0 holds the first half of each of Q, K, V
    assert torch.equal(qkv, torch.cat([*(h[0] for h in halves), *(h[1] for h in halves)]))


def test_a_two_rank_folder_is_refused_by_one_process(two_rank_run) -> None:
    checkpoint, compiled, _, _ = two_rank_run
    app = from_pretrained(checkpoint, NeuronConfig(**SETTINGS))
    with pytest.raises(ArtefactError, match="ranks: 2 -> 1"):
        app.load(compiled, quiet=True)


def test_a_launch_of_another_size_than_tp_degree_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"3 processes were launched .* tp_degree is 2"):
        join_launched_ranks(2)
