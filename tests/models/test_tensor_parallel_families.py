"""tp_degree=2 over two gloo ranks beyond Llama: Qwen2's biased (fused) Q/K/V, Mistral's
sliding window shorter than the sequence, and query heads that do not divide by tp_degree
(padded with zero heads, as NxD Inference pads them; GPT-OSS also pads its per-head sinks),
eager and compiled, each rank against HF's greedy tokens. One spawn serves every model
(starting the ranks is the cost)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from nxdplug import MoENeuronConfig, NeuronConfig, from_pretrained
from nxdplug.testing import end_rank_process, hf_greedy
from tests.core.modules.test_tensor_parallel import (
    MASK,
    NEW_TOKENS,
    PROMPTS,
    become_launched_rank,
    free_port,
)
from tests.core.modules.test_tensor_parallel import generate as generate_tokens

pytestmark = pytest.mark.slow

SETTINGS = {
    "torch_dtype": "float32",
    "batch_size": 2,
    "seq_len": 48,
    "max_context_length": 16,
    "tp_degree": 2,
    "enable_bucketing": False,  # one graph per submodel keeps compile() short
}


class Family(NamedTuple):
    architecture: str
    checkpoint: dict[str, Any]  # tiny_checkpoint overrides
    settings: dict[str, Any]  # NeuronConfig settings beyond SETTINGS
    steps: tuple[str, ...] = ("eager", "compiled")
    config_class: type = NeuronConfig


FAMILIES = {
    # Qwen2 has biases on Q, K and V: fused, the bias is split part by part over the ranks.
    "qwen2": Family("qwen2", {"seed": 3}, {"fused_qkv": True}),
    # 6 prompt + 20 new tokens run past the window of 8 (compiled windows: test_gpt_oss.py).
    "mistral": Family("mistral", {"seed": 7, "sliding_window": 8}, {}, steps=("eager",)),
    # 3 query heads, 1 K/V head: 4 query heads (the last one zero), the K/V head on both ranks.
    # The padding is done to the weights before they are sharded: eager alone shows it.
    "llama-3-heads": Family(
        "llama",
        {"seed": 5, "hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1},
        {},
        steps=("eager",),
    ),
    # 3 heads, MHA: converted and padded to 4 query and 4 K/V heads, fused; sinks padded too.
    "gpt_oss-3-heads": Family(
        "gpt_oss",
        {"seed": 2, "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 16},
        {"fused_qkv": True},
        steps=("eager",),
        config_class=MoENeuronConfig,
    ),
}
RUNS = [(family, step) for family, spec in FAMILIES.items() for step in spec.steps]


def _rank(rank: int, world: int, port: int, checkpoints: str, work: str) -> None:
    become_launched_rank(rank, world, port)
    import torch.distributed as dist

    try:
        for family, path in json.loads(checkpoints).items():
            spec = FAMILIES[family]
            app = from_pretrained(path, spec.config_class(**SETTINGS, **spec.settings))
            app.to_cpu()
            attention = app.context_encoding_model.model.layers[0].self_attn
            facts = {"sliding_window": getattr(attention, "sliding_window", None)}
            if hasattr(attention, "qkv_proj") and attention.qkv_proj.bias is not None:
                facts["qkv_bias_rows"] = attention.qkv_proj.bias.shape[0]
            facts["query_heads"] = attention.num_heads
            if hasattr(attention, "q_proj"):
                rows = attention.q_proj.weight.detach().reshape(attention.num_heads, -1)
                facts["zero_query_heads"] = int((rows == 0).all(dim=1).sum())
            if hasattr(attention, "sinks"):
                facts["sinks"] = attention.sinks.detach().tolist()
            (Path(work) / f"{family}-facts-{rank}.json").write_text(json.dumps(facts))
            torch.save(generate_tokens(app), Path(work) / f"{family}-eager-{rank}.pt")
            if "compiled" not in spec.steps:
                continue
            compiled = Path(work) / f"{family}-compiled"
            app = from_pretrained(path, spec.config_class(**SETTINGS, **spec.settings))
            app.compile(compiled, quiet=True)
            app.load(compiled, quiet=True)
            torch.save(generate_tokens(app), Path(work) / f"{family}-compiled-{rank}.pt")
        end_rank_process()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_run(tiny_checkpoint, tmp_path_factory):
    checkpoints = {
        family: tiny_checkpoint(spec.architecture, **spec.checkpoint)
        for family, spec in FAMILIES.items()
    }
    work = tmp_path_factory.mktemp("tp2-families")
    paths = json.dumps({family: str(path) for family, path in checkpoints.items()})
    mp.spawn(_rank, args=(2, free_port(), paths, str(work)), nprocs=2, join=True)
    expected = {}
    for family, path in checkpoints.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        expected[family] = hf_greedy(hf, PROMPTS, MASK, NEW_TOKENS).sequences
    unwindowed = tiny_checkpoint(
        "mistral", **(FAMILIES["mistral"].checkpoint | {"sliding_window": None})
    )
    hf = AutoModelForCausalLM.from_pretrained(unwindowed, dtype=torch.float32)
    expected["mistral without window"] = hf_greedy(hf, PROMPTS, MASK, NEW_TOKENS).sequences
    return work, expected


@pytest.mark.parametrize(("family", "step"), RUNS)
def test_every_rank_generates_hf_greedy_tokens(two_rank_run, family: str, step: str) -> None:
    work, expected = two_rank_run
    tokens = expected[family]
    new = tokens[:, PROMPTS.shape[1] :]
    assert len(set(new.flatten().tolist())) > 3  # not one token
    assert (new != 0).all()  # no eos (id 0), at which HF would stop and pad
    for rank in range(2):
        assert torch.equal(torch.load(work / f"{family}-{step}-{rank}.pt"), tokens), rank


def test_each_rank_holds_half_of_qwen2s_qkv_bias_and_mistrals_window(two_rank_run) -> None:
    work, expected = two_rank_run
    assert PROMPTS.shape[1] + NEW_TOKENS > 8  # the window is passed, and it changes the tokens
    assert not torch.equal(expected["mistral"], expected["mistral without window"])
    for rank in range(2):
        qwen2 = json.loads((work / f"qwen2-facts-{rank}.json").read_text())
        # 4 query heads and 2 K/V heads of width 16: (64 + 32 + 32) rows, half on each rank.
        assert (qwen2["sliding_window"], qwen2["qkv_bias_rows"]) == (None, 64)
        mistral = json.loads((work / f"mistral-facts-{rank}.json").read_text())
        assert mistral["sliding_window"] == 8


def test_query_heads_are_padded_to_a_multiple_of_tp_degree(two_rank_run) -> None:
    work, _ = two_rank_run
    llama = [json.loads((work / f"llama-3-heads-facts-{r}.json").read_text()) for r in range(2)]
    # Heads 1, 2 on rank 0; head 3 and the zero padding head on rank 1.
    assert [facts["query_heads"] for facts in llama] == [2, 2]
    assert [facts["zero_query_heads"] for facts in llama] == [0, 1]
    gpt_oss = [json.loads((work / f"gpt_oss-3-heads-facts-{r}.json").read_text()) for r in range(2)]
    assert [facts["query_heads"] for facts in gpt_oss] == [2, 2]
    assert gpt_oss[1]["sinks"][1] == 0.0 and all(gpt_oss[0]["sinks"] + gpt_oss[1]["sinks"][:1])


def test_the_documented_torchrun_command_prints_hf_tokens_from_rank_0(tiny_checkpoint, tmp_path):
    """docs/tensor-parallelism.md's torchrun command line, on a tiny checkpoint."""
    bin_dir = Path(sys.executable).parent
    torchrun, nxdplug = (
        shutil.which("torchrun", path=bin_dir),
        shutil.which("nxdplug", path=bin_dir),
    )
    if torchrun is None or nxdplug is None:
        pytest.skip(f"torchrun or nxdplug is not installed in {bin_dir}")
    checkpoint = tiny_checkpoint("llama", seed=11)
    compiled = tmp_path / "tp2"
    # The documented line, plus a free rendezvous port: others may run torchrun on 29500 meanwhile.
    command = [torchrun, "--nproc-per-node", "2", "--master-port", str(free_port())]
    command += [nxdplug, "run", "--model-path", str(checkpoint)]
    command += ["--tp-degree", "2", "--compiled-model-path", str(compiled)]
    command += ["--prompt", "class Stack:", "--max-new-tokens", "40", "--seq-len", "128"]
    command += ["--torch-dtype", "float32", "--check-accuracy-mode", "token-matching"]
    env = os.environ | {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    # Rank 0 prints, once; both ranks compiled their graphs and weight shards.
    assert output.count("Output 0: class Stack:") == 1, output[-4000:]
    assert output.count("token matching: PASS (1 rows x 40 tokens identical to HF)") == 1
    assert sorted(p.name for p in (compiled / "weights").iterdir()) == [
        "rank0.safetensors",
        "rank1.safetensors",
    ]
    assert time.monotonic() - start < 120  # about 30 s on 2 cores
