"""How a rank's experts are laid out: expert parallelism (whole experts split over ranks) times
tensor parallelism (each expert's intermediate dim split), over all the launched ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from nxdplug.config.moe import parallel_degree_problems
from nxdplug.errors import ConfigError
from nxdplug.modules.parallel_linear import TP, tp_rank, tp_world_size

if TYPE_CHECKING:
    from nxdplug.config import MoENeuronConfig


@attrs.frozen
class MoEDegrees:
    """This rank's place in the expert layout: ``world == tp_degree * ep_degree`` ranks, rank
    ``rank`` holding expert block ``ep_rank`` and intermediate slice ``tp_rank``."""

    tp_degree: int
    ep_degree: int
    rank: int
    group: str = TP

    @property
    def world(self) -> int:
        return self.tp_degree * self.ep_degree

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_degree

    @property
    def ep_rank(self) -> int:
        return self.rank // self.tp_degree


def rank_layout(tp_degree: int, ep_degree: int) -> MoEDegrees:
    """This rank's place in a layout of ``tp_degree x ep_degree`` ranks; one process (tests,
    ``to_cpu``) holds every expert whole."""
    if tp_world_size() == 1:
        return MoEDegrees(tp_degree=1, ep_degree=1, rank=0)
    return MoEDegrees(tp_degree=tp_degree, ep_degree=ep_degree, rank=tp_rank())


def moe_degrees(neuron_config: MoENeuronConfig) -> MoEDegrees:
    """The expert layout of this rank. With both degrees left at 1 and several ranks, each
    expert is split over all of them (tensor parallelism, as for the dense MLP)."""
    problems = parallel_degree_problems(neuron_config)
    if problems:
        raise ConfigError(problems)
    moe_tp, moe_ep = neuron_config.moe_tp_degree, neuron_config.moe_ep_degree
    if moe_tp * moe_ep == 1:
        moe_tp = tp_world_size()
    return rank_layout(moe_tp, moe_ep)
