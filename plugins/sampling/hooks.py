"""Samplers: greedy and multinomial on the host, and on-device sampling (a feature enabled by
``on_device_sampling_config``, which puts the draw inside the model's graph: its per-row
inputs are a step-input record, its tokens the model's output stage)."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import CliExtension, Feature, Sampler, StepInput, hookimpl

NXDPLUG_API_VERSION = 2

ENABLED_BY = ("on_device_sampling_config",)
ON_DEVICE = "nxdplug.plugins.sampling.on_device"


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
        enabled_by=ENABLED_BY,
        validate=f"{ON_DEVICE}:validate_on_device_sampling",
        transform_model=f"{ON_DEVICE}:install_sampler",
        token_source="nxdplug.plugins.sampling.generation:device_token_source",
        request_sampling="nxdplug.plugins.sampling.request_sampling:RequestSampling",
        # The host turns these into graph inputs (sampling_params, the noise's seed).
        runtime_settings=tuple(
            f"on_device_sampling_config.{name}"
            for name in ("top_k", "top_p", "temperature", "deterministic")
        ),
        description="the graph samples (greedy, or temperature/top-k/top-p) and returns tokens",
    )


@hookimpl
def nxdplug_step_inputs() -> Iterable[StepInput]:
    yield StepInput(
        name="sampling-inputs",
        enabled_by=ENABLED_BY,
        builder=f"{ON_DEVICE}:SamplingInputs",
        inputs=("sampling_params", "sampling_noise"),
        keywords=("sampling_params",),
        description="per-row (top_k, top_p, temperature) and the noise of the draw",
    )


@hookimpl
def nxdplug_cli_extensions() -> Iterable[CliExtension]:
    yield CliExtension(
        name="sampling-inference-demo",
        implementation="nxdplug.plugins.sampling.demo_flags:SamplingDemoFlags",
        commands=("inference_demo",),
        description="inference_demo's on-device sampling flags (--on-device-sampling, ...)",
    )
