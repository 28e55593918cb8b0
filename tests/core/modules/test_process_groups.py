"""Named process groups: the core's ``tp`` over every rank, and groups a plugin lays out.

Two gloo ranks, started the way torchrun starts them. A test plugin declares ``solo`` (each
rank alone) for configs that set ``solo_group``; layers sharded over ``tp`` and over ``solo``
compute the same product, and the collectives reach only their group's ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from nxdplug import NeuronConfig, from_pretrained, hookimpl
from nxdplug.errors import ConfigError
from nxdplug.modules.parallel_linear import RowParallelLinear, all_reduce_sum, shard_tensor
from nxdplug.modules.process_groups import ParallelLayout, current_layout, group_rank, group_size
from nxdplug.testing import end_rank_process, temporary_plugin
from nxdplug.types import Feature, ParallelGroup
from tests.core.modules.test_tensor_parallel import become_launched_rank, free_port


def each_rank_alone(world_size: int, config: object) -> list[list[int]]:
    return [[rank] for rank in range(world_size)]


class SoloGroupPlugin:
    NXDPLUG_API_VERSION = 2

    @hookimpl
    def nxdplug_features(self):
        yield Feature(name="solo-group", enabled_by=("solo_group",), settings={"solo_group": False})

    @hookimpl
    def nxdplug_parallel_groups(self):
        yield ParallelGroup(
            name="solo", partition=f"{__name__}:each_rank_alone", enabled_by=("solo_group",)
        )


def test_one_process_is_one_rank_in_every_group() -> None:
    layout = current_layout()
    assert (group_size("tp"), group_rank("tp"), layout.block("tp")) == (1, 0, (0,))
    with pytest.raises(ConfigError, match="no process group 'ep' is laid out"):
        group_size("ep")


def test_a_partition_must_cover_every_rank_in_equal_blocks() -> None:
    layout = ParallelLayout(world_size=4, rank=1)
    for bad in ([[0, 1], [2]], [[0, 1], [1, 2, 3]], [[0, 1, 2], [3]]):
        with pytest.raises(ConfigError, match="must split the 4 rank"):
            layout.add("ep", bad)
    layout.partitions["ep"] = ((0, 1), (2, 3))  # as add() records it, without making groups
    layout.handles["ep"] = "group of 0 and 1"
    assert (layout.size("ep"), layout.rank_in("ep"), layout.process_group("ep")) == (
        2,
        1,
        "group of 0 and 1",
    )
    with pytest.raises(ConfigError, match="laid out as"):
        layout.add("ep", [[0, 2], [1, 3]])


def _rank(rank: int, world: int, port: int, checkpoint: str, out: str) -> None:
    become_launched_rank(rank, world, port)
    import torch.distributed as dist

    try:
        with temporary_plugin(SoloGroupPlugin(), "solo-group"):
            settings = {"torch_dtype": "float32", "seq_len": 32, "tp_degree": 2}
            from_pretrained(checkpoint, NeuronConfig(solo_group=True, **settings))
            value = torch.full((3,), float(rank + 1))
            weight = torch.arange(24, dtype=torch.float32).view(4, 6) / 10
            x = torch.linspace(-1, 1, 12).view(2, 6)
            whole_input = {"input_is_parallel": False}
            over_tp = RowParallelLinear(
                6, 4, tp_degree=2, rank=group_rank("tp"), group="tp", **whole_input
            )
            over_tp.weight.data = shard_tensor(weight, 1, 2, group_rank("tp"))
            alone = RowParallelLinear(
                6, 4, tp_degree=group_size("solo"), group="solo", **whole_input
            )
            alone.weight.data = weight
            result = {
                "solo": (group_size("solo"), group_rank("solo"), current_layout().block("solo")),
                "tp": (group_size("tp"), group_rank("tp")),
                "sum_tp": all_reduce_sum(value, "tp"),
                "sum_solo": all_reduce_sum(value, "solo"),
                "row_tp": over_tp(x),
                "row_solo": alone(x),
                "expected": x @ weight.T,
            }
            torch.save(result, Path(out) / f"rank{rank}.pt")
        end_rank_process()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tiny_checkpoint, tmp_path_factory):
    checkpoint = tiny_checkpoint("llama", seed=11)
    out = tmp_path_factory.mktemp("groups")
    mp.spawn(_rank, args=(2, free_port(), str(checkpoint), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


@pytest.mark.slow
def test_a_plugin_group_is_laid_out_on_every_rank(two_ranks) -> None:
    for rank, result in enumerate(two_ranks):
        assert result["solo"] == (1, 0, (rank,))
        assert result["tp"] == (2, rank)


@pytest.mark.slow
def test_collectives_reach_only_their_groups_ranks(two_ranks) -> None:
    for rank, result in enumerate(two_ranks):
        assert torch.equal(result["sum_tp"], torch.full((3,), 3.0))  # 1 + 2
        assert torch.equal(result["sum_solo"], torch.full((3,), float(rank + 1)))


@pytest.mark.slow
def test_a_layer_is_sharded_over_the_group_it_names(two_ranks) -> None:
    for result in two_ranks:
        torch.testing.assert_close(result["row_tp"], result["expected"])
        torch.testing.assert_close(result["row_solo"], result["expected"])
