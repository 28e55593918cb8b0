"""Flash decoding: the KV cache of a K/V head shared by two ranks split along the sequence
between them, each rank's partial attention merged exactly.

The merge is checked in one process against the whole attention (ranks simulated by slicing
the cache); two gloo ranks then generate HF's greedy tokens, eager and compiled, each holding
half the cache positions.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nxdplug import NeuronConfig, from_pretrained
from nxdplug.config import InferenceConfig, load_pretrained_config
from nxdplug.modules.attention import attention_mask_4d, grouped_attention
from nxdplug.pipeline import config_problems
from nxdplug.plugins.flash_decoding.attention import (
    held_length,
    held_mask,
    held_slots,
    merge_partials,
    partial_attention,
)
from nxdplug.plugins.flash_decoding.layout import ranks_sharing_a_kv_head
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
    "flash_decoding_enabled": True,
}


def split_over_ranks(q, k, v, mask, size: int) -> torch.Tensor:
    """The merged attention of ``size`` simulated ranks, each holding every size-th key."""
    length = held_length(k.shape[2], size)
    partials = []
    for rank in range(size):
        held_k = torch.zeros(k.shape[0], 1, length, k.shape[3])
        held_v = torch.zeros_like(held_k)
        held_k[:, :, : k[:, :, rank::size].shape[2]] = k[:, :, rank::size]
        held_v[:, :, : v[:, :, rank::size].shape[2]] = v[:, :, rank::size]
        partials.append(partial_attention(q, held_k, held_v, held_mask(mask, rank, size)))
    return merge_partials(torch.stack(partials))


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("queries", [1, 5])
def test_merged_partials_equal_the_whole_attention(size, window, queries) -> None:
    torch.manual_seed(size * 10 + queries)
    keys, heads, dim = 11, 4, 8
    q = torch.randn(2, heads, queries, dim) * 3
    k, v = torch.randn(2, 1, keys, dim) * 3, torch.randn(2, 1, keys, dim)
    key_mask = torch.ones(2, keys, dtype=torch.long)
    key_mask[1, :3] = 0  # a left-padded row
    # row 0 is a prompt from position 0 (its first query sees one key: on one rank only)
    starts = torch.tensor([[0], [keys - queries]])
    position_ids = starts + torch.arange(queries)
    mask = attention_mask_4d(key_mask, position_ids, window)
    expected = grouped_attention(q, k, v, mask)
    torch.testing.assert_close(split_over_ranks(q, k, v, mask, size), expected)


def test_a_query_that_sees_no_key_anywhere_stays_finite() -> None:
    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4)
    mask = torch.zeros(1, 1, 1, 6, dtype=torch.bool)
    assert torch.isfinite(split_over_ranks(q, k, v, mask, 2)).all()


def test_each_position_goes_to_one_rank_and_the_others_write_the_spare_slot() -> None:
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6]])
    assert held_slots(positions, 0, 3, 99).tolist() == [[0, 99, 99, 1, 99, 99, 2]]
    assert held_slots(positions, 2, 3, 99).tolist() == [[99, 99, 0, 99, 99, 1, 99]]
    mask = torch.tensor([[True, True, False, True, True]])
    assert held_mask(mask, 1, 2).tolist() == [[True, True, False]]  # positions 1, 3, (5)


@pytest.mark.parametrize(
    ("world", "kv_heads", "blocks"),
    [(4, 2, [[0, 1], [2, 3]]), (4, 1, [[0, 1, 2, 3]]), (1, 1, [[0]]), (1, 2, [[0]])],
)
def test_the_kv_groups_are_the_ranks_of_one_kv_head(world, kv_heads, blocks) -> None:
    config = SimpleNamespace(num_attention_heads=8, num_key_value_heads=kv_heads)
    assert [list(b) for b in ranks_sharing_a_kv_head(world, config)] == blocks


@pytest.mark.parametrize(
    ("options", "kv_heads", "problem"),
    [
        ({"tp_degree": 2}, 2, "tp_degree (2) must be a multiple of num_key_value_heads (2)"),
        ({"tp_degree": 1}, 1, "and larger; raise tp_degree"),
        ({"tp_degree": 8}, 1, "num_attention_heads (4) divisible by tp_degree (8)"),
        (
            {"tp_degree": 2, "speculation_length": 3, "trace_tokengen_model": False},
            1,
            "flash_decoding_enabled with speculation is not implemented",
        ),
    ],
)
def test_layouts_it_cannot_split_are_refused(tiny_checkpoint, options, kv_heads, problem):
    path = tiny_checkpoint("llama", num_key_value_heads=kv_heads)
    neuron = NeuronConfig(torch_dtype="float32", seq_len=32, flash_decoding_enabled=True, **options)
    config = InferenceConfig(neuron, load_config=load_pretrained_config(path))
    assert any(problem in p for p in config_problems(config)), config_problems(config)


def test_one_process_keeps_every_position_and_says_so(tiny_checkpoint) -> None:
    checkpoint = tiny_checkpoint("llama", seed=11, num_key_value_heads=1)
    app = from_pretrained(checkpoint, NeuronConfig(**SETTINGS))
    with pytest.warns(RuntimeWarning, match="every position stays in its cache"):
        app.to_cpu()
    assert app.context_encoding_model.model.kv_mgr.layout.max_length == SETTINGS["seq_len"]


def cache_bytes(app) -> int:
    return sum(
        b.numel() * b.element_size() for b in app.context_encoding_model.model.kv_mgr.buffers()
    )


def _rank(rank: int, world: int, port: int, checkpoint: str, work: str) -> None:
    become_launched_rank(rank, world, port)
    import torch.distributed as dist

    try:
        replicated = from_pretrained(
            checkpoint, NeuronConfig(**SETTINGS | {"flash_decoding_enabled": False})
        )
        replicated.to_cpu()
        app = from_pretrained(checkpoint, NeuronConfig(**SETTINGS))
        app.to_cpu()
        sizes = {"replicated": cache_bytes(replicated), "split": cache_bytes(app)}
        (Path(work) / f"cache-{rank}.json").write_text(json.dumps(sizes))
        torch.save(generate_tokens(app), Path(work) / f"eager-{rank}.pt")
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
    """Two ranks sharing the model's one K/V head: eager generation, then compiled."""
    checkpoint = tiny_checkpoint("llama", seed=11, num_key_value_heads=1)
    work = tmp_path_factory.mktemp("flash2")
    spawn_two_ranks(_rank, str(checkpoint), str(work))
    return work, hf_greedy_tokens(checkpoint)


@pytest.mark.slow
@pytest.mark.parametrize("step", ["eager", "compiled"])
def test_every_rank_generates_hf_greedy_tokens(two_rank_run, step) -> None:
    work, expected = two_rank_run
    assert_every_rank_generated(work, step, expected)


@pytest.mark.slow
def test_each_rank_caches_half_the_positions(two_rank_run) -> None:
    """48 positions: 24 per rank plus the spare slot, against 48 on each rank replicated."""
    work, _ = two_rank_run
    for rank in range(2):
        sizes = json.loads((work / f"cache-{rank}.json").read_text())
        assert sizes["split"] * 48 == sizes["replicated"] * 25, sizes
