from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from nxdplug.errors import ConfigError, PluginError
from nxdplug.modules import parallel_linear
from nxdplug.modules.parallel_linear import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    ShardedLinear,
    WeightMethod,
    set_weight_method,
    shard_tensor,
    tp_world_size,
)
from nxdplug.testing import end_rank_process

TP_DEGREES = (1, 2, 4)
IN, OUT, VOCAB = 8, 12, 10


def full_linear(bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(IN, OUT, bias=bias, dtype=torch.float64)


def sample_input() -> torch.Tensor:
    return torch.randn(2, 3, IN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def column_shard(full: nn.Linear, tp: int, rank: int, **kwargs: object) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(
        IN, OUT, bias=full.bias is not None, tp_degree=tp, rank=rank, dtype=torch.float64, **kwargs
    )
    layer.load_state_dict(layer.shard_state_dict(full.state_dict()))
    return layer


def row_shard(full: nn.Linear, tp: int, rank: int, **kwargs: object) -> RowParallelLinear:
    layer = RowParallelLinear(
        IN, OUT, bias=full.bias is not None, tp_degree=tp, rank=rank, dtype=torch.float64, **kwargs
    )
    layer.load_state_dict(layer.shard_state_dict(full.state_dict()))
    return layer


def embedding_shard(full: nn.Embedding, tp: int, rank: int) -> ParallelEmbedding:
    layer = ParallelEmbedding(VOCAB, OUT, tp_degree=tp, rank=rank, dtype=torch.float64)
    layer.load_state_dict(layer.shard_state_dict(full.state_dict()))
    return layer


# --- one process, each rank's shard run on its own --------------------------------------------


def test_no_process_group_means_one_rank() -> None:
    assert not dist.is_initialized()
    assert tp_world_size() == 1


@pytest.mark.parametrize("tp", TP_DEGREES)
@pytest.mark.parametrize("gather_output", [False, True])
def test_column_shards_concatenate_to_full_output(tp: int, gather_output: bool) -> None:
    full, x = full_linear(), sample_input()

    outputs = [column_shard(full, tp, r, gather_output=gather_output)(x) for r in range(tp)]

    assert all(out.shape == (2, 3, OUT // tp) for out in outputs)
    torch.testing.assert_close(torch.cat(outputs, dim=-1), full(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tp", TP_DEGREES)
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_partials_sum_to_full_output(tp: int, input_is_parallel: bool) -> None:
    full, x = full_linear(), sample_input()
    layers = [row_shard(full, tp, r, input_is_parallel=input_is_parallel) for r in range(tp)]

    inputs = [shard_tensor(x, -1, tp, r) if input_is_parallel else x for r in range(tp)]
    partials = [layer(x_r) for layer, x_r in zip(layers, inputs, strict=True)]

    # Without a process group each rank adds the bias to its own partial; the all-reduce
    # that would run between the matmul and the bias is the sum taken here.
    bias = full.bias.detach()
    total = sum(p - bias for p in partials) + bias
    torch.testing.assert_close(total, full(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tp", TP_DEGREES)
def test_row_without_bias(tp: int) -> None:
    full, x = full_linear(bias=False), sample_input()

    total = sum(row_shard(full, tp, r)(shard_tensor(x, -1, tp, r)) for r in range(tp))

    torch.testing.assert_close(total, full(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tp", TP_DEGREES)
def test_embedding_shards_concatenate_to_full_output(tp: int) -> None:
    torch.manual_seed(0)
    full = nn.Embedding(VOCAB, OUT, dtype=torch.float64)
    ids = torch.tensor([[0, 3, 9], [5, 5, 1]])

    outputs = [embedding_shard(full, tp, r)(ids) for r in range(tp)]

    assert torch.equal(torch.cat(outputs, dim=-1), full(ids))


def test_shard_state_dict_shapes() -> None:
    full = full_linear().state_dict()

    column = ColumnParallelLinear(IN, OUT, bias=True, tp_degree=4, rank=1).shard_state_dict(full)
    row = RowParallelLinear(IN, OUT, bias=True, tp_degree=4, rank=1).shard_state_dict(full)

    assert column["weight"].shape == (3, IN) and column["bias"].shape == (3,)
    assert torch.equal(column["weight"], full["weight"][3:6])
    assert row["weight"].shape == (OUT, 2) and torch.equal(row["weight"], full["weight"][:, 2:4])
    assert row["bias"] is full["bias"]


def test_a_fused_projection_is_split_part_by_part() -> None:
    torch.manual_seed(0)
    q, k, v = (nn.Linear(IN, n, bias=True, dtype=torch.float64) for n in (8, 4, 4))
    fused = {
        "weight": torch.cat([q.weight, k.weight, v.weight]),
        "bias": torch.cat([q.bias, k.bias, v.bias]),
        "weight_scale": torch.ones(1),
    }
    x = sample_input()

    for rank in range(2):
        layer = ColumnParallelLinear(
            IN, 16, bias=True, tp_degree=2, rank=rank, dtype=torch.float64, partitions=(8, 4, 4)
        )
        shard = layer.shard_state_dict(fused)
        assert torch.equal(shard["weight_scale"], fused["weight_scale"])
        del shard["weight_scale"]
        layer.load_state_dict(shard)
        q_part, k_part, v_part = layer(x).split([4, 2, 2], dim=-1)
        torch.testing.assert_close(q_part, q(x)[..., 4 * rank : 4 * rank + 4])
        torch.testing.assert_close(k_part, k(x)[..., 2 * rank : 2 * rank + 2])
        torch.testing.assert_close(v_part, v(x)[..., 2 * rank : 2 * rank + 2])


def test_partitions_must_add_up_to_the_output() -> None:
    with pytest.raises(ConfigError, match="do not add up"):
        ColumnParallelLinear(IN, 16, partitions=(8, 4))


@pytest.mark.parametrize(
    "build",
    [
        lambda: ColumnParallelLinear(8, 10, tp_degree=4),
        lambda: RowParallelLinear(10, 8, tp_degree=4),
        lambda: ParallelEmbedding(8, 10, tp_degree=4),
        lambda: ColumnParallelLinear(8, 8, tp_degree=2, rank=2),
        lambda: RowParallelLinear(8, 8, tp_degree=0),
        lambda: shard_tensor(torch.zeros(6), 0, 4, 0),
    ],
)
def test_bad_sizes_or_ranks_are_config_errors(build) -> None:
    with pytest.raises(ConfigError, match="tp_degree"):
        build()


def test_layers_export_to_one_graph() -> None:
    model = nn.Sequential(
        ParallelEmbedding(VOCAB, 2 * IN, tp_degree=2, rank=1),
        ColumnParallelLinear(IN, OUT, bias=True, gather_output=True),
        RowParallelLinear(OUT, IN, bias=True, tp_degree=2, rank=0, input_is_parallel=False),
    )
    ids = torch.tensor([[1, 2, 3]])

    exported = torch.export.export(model, (ids,))

    torch.testing.assert_close(exported.module()(ids), model(ids))


# --- weight methods and output deltas -----------------------------------------------------------


class TransposedWeight(WeightMethod):
    """A weight held as [in, out] under the name ``weight_t``: another form of the weight."""

    def create_weights(self, layer: ShardedLinear) -> None:
        layer.weight_t = nn.Parameter(layer.weight.detach().T.contiguous())
        del layer.weight

    def apply(
        self, layer: ShardedLinear, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return F.linear(x, layer.weight_t.T, bias)


class ShiftDelta:
    """Adds ``x.sum(-1) * shift`` to every output; ``shift`` [out] is sharded like the rows."""

    parameter_names = ("shift",)

    def compute(self, layer: ShardedLinear, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1, keepdim=True) * layer.shift

    def shard_state_dict(
        self, layer: ShardedLinear, full: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        out = layer.shift.shape[0]
        return {"shift": full["shift"][layer.rank * out : (layer.rank + 1) * out]}


def test_a_second_weight_method_is_refused_naming_both_claimants() -> None:
    full, x = full_linear(), sample_input()
    layer = column_shard(full, 1, 0)
    set_weight_method(layer, TransposedWeight(), claimant="plugin-a")
    assert "weight" not in layer.state_dict() and "weight_t" in layer.state_dict()
    torch.testing.assert_close(layer(x), full(x), rtol=1e-12, atol=1e-12)

    with pytest.raises(
        PluginError,
        match=r"'plugin-b' and 'plugin-a' both claim ColumnParallelLinear.weight_method",
    ):
        set_weight_method(layer, WeightMethod(), claimant="plugin-b")
    assert type(layer.weight_method) is TransposedWeight  # the first claim stands


@pytest.mark.parametrize("tp", (1, 2))
def test_output_deltas_add_to_each_ranks_product(tp: int) -> None:
    """On a column-parallel layer the delta adds to the rank's output slice; on a row-parallel
    one to its partial sum, before the bias the sum gets once. Each delta shards its own
    parameters."""
    full, x = full_linear(), sample_input()
    shift = torch.randn(OUT, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    expected_column = full(x) + x.sum(-1, keepdim=True) * shift

    columns = []
    for rank in range(tp):
        layer = ColumnParallelLinear(IN, OUT, bias=True, tp_degree=tp, rank=rank)
        layer.shift = nn.Parameter(torch.empty(OUT // tp, dtype=torch.float64))
        layer.double().output_deltas = (ShiftDelta(),)
        layer.load_state_dict(layer.shard_state_dict(full.state_dict() | {"shift": shift}))
        columns.append(layer(x))
    torch.testing.assert_close(torch.cat(columns, -1), expected_column, rtol=1e-12, atol=1e-12)

    row = RowParallelLinear(IN, OUT, bias=True, dtype=torch.float64)
    row.shift = nn.Parameter(shift.clone())
    row.output_deltas = (ShiftDelta(),)
    row.load_state_dict(row.shard_state_dict(full.state_dict() | {"shift": shift}))
    torch.testing.assert_close(row(x), expected_column, rtol=1e-12, atol=1e-12)


# --- two real processes over gloo -------------------------------------------------------------


def _distributed_worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        assert tp_world_size() == world
        full, x = full_linear(), sample_input()
        expected = full(x)

        column = column_shard(full, world, rank, gather_output=True)
        torch.testing.assert_close(column(x), expected, rtol=1e-12, atol=1e-12)

        row = row_shard(full, world, rank)
        torch.testing.assert_close(
            row(shard_tensor(x, -1, world, rank)), expected, rtol=1e-12, atol=1e-12
        )
        row_full_input = row_shard(full, world, rank, input_is_parallel=False)
        torch.testing.assert_close(row_full_input(x), expected, rtol=1e-12, atol=1e-12)

        # Column -> row, the MLP pattern: no gather in between.
        up = column_shard(full, world, rank)
        down = RowParallelLinear(OUT, IN, tp_degree=world, rank=rank, dtype=torch.float64)
        torch.manual_seed(1)  # the same full weight on every rank
        full_down = nn.Linear(OUT, IN, bias=False, dtype=torch.float64)
        down.load_state_dict(down.shard_state_dict(full_down.state_dict()))
        torch.testing.assert_close(down(up(x)), full_down(full(x)), rtol=1e-12, atol=1e-12)

        reduced_in: list[torch.dtype] = []
        real_all_reduce = parallel_linear.all_reduce_sum

        def recording_all_reduce(tensor: torch.Tensor, group: str) -> torch.Tensor:
            reduced_in.append(tensor.dtype)
            return real_all_reduce(tensor, group)

        parallel_linear.all_reduce_sum = recording_all_reduce  # this process ends right after
        bf16_row = row_shard(full, world, rank, reduce_dtype=torch.float32).to(torch.bfloat16)
        out = bf16_row(shard_tensor(x, -1, world, rank).to(torch.bfloat16))
        assert reduced_in == [torch.float32]
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), expected, rtol=0.05, atol=0.05)

        torch.manual_seed(0)
        full_embedding = nn.Embedding(VOCAB, OUT, dtype=torch.float64)
        ids = torch.tensor([[0, 3, 9]])
        assert torch.equal(embedding_shard(full_embedding, world, rank)(ids), full_embedding(ids))

        with_wrong_tp = ColumnParallelLinear(IN, OUT, gather_output=True, tp_degree=4, rank=rank)
        try:
            with_wrong_tp(x.float())
        except ConfigError as exc:
            assert "process group has 2 ranks" in str(exc)
        else:
            raise AssertionError("tp_degree 4 in a group of 2 ranks was accepted")
        end_rank_process()
    finally:
        dist.destroy_process_group()


def test_two_ranks_over_gloo(tmp_path: Path) -> None:
    mp.spawn(_distributed_worker, args=(2, str(tmp_path / "rendezvous")), nprocs=2, join=True)
