"""Samplers: greedy and multinomial on the host, and on-device sampling (a feature enabled by
``on_device_sampling_config``, which puts the draw inside the model's graph)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from nxdplug.hookspecs import hookimpl
from nxdplug.types import Feature, Sampler

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


@hookimpl
def nxdplug_features() -> Iterable[Feature]:
    yield Feature(
        name="on-device-sampling",
        enabled_by=("on_device_sampling_config",),
        description="the graph samples (greedy, or temperature/top-k/top-p) and returns tokens",
    )


# The pipeline hooks below run only for configs that enable on-device-sampling.


@hookimpl
def nxdplug_validate_config(config: Any) -> Iterable[str]:
    from nxdplug.plugins.sampling.on_device import on_device_sampling_problems

    return on_device_sampling_problems(
        config.neuron_config.on_device_sampling_config, getattr(config, "vocab_size", None)
    )


@hookimpl
def nxdplug_transform_model(model: Any, config: Any) -> None:
    from nxdplug.plugins.sampling.on_device import OnDeviceSampler

    model.sampler = OnDeviceSampler(config.neuron_config.on_device_sampling_config)
