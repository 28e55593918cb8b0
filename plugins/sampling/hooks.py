"""Host-side samplers: greedy and multinomial (temperature, top-k, top-p)."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.hookspecs import hookimpl
from nxdplug.types import Sampler

NXDPLUG_API_VERSION = 1


@hookimpl
def nxdplug_samplers() -> Iterable[Sampler]:
    yield Sampler(
        name="greedy",
        implementation="nxdplug.plugins.sampling.samplers:GreedySampler",
        description="the highest-scoring token",
    )
    yield Sampler(
        name="multinomial",
        implementation="nxdplug.plugins.sampling.samplers:MultinomialSampler",
        description="temperature, top-k and top-p, then a multinomial draw",
    )
