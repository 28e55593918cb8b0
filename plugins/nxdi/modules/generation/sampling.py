"""NxD Inference's ``modules.generation.sampling``: its ``Sampler`` module and the helpers for
the per-row ``sampling_params`` it takes, under its names and signatures."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(
    __name__,
    {
        "Sampler": "nxdplug.runtime.batch_sampler:Sampler",
        "prepare_sampling_params": "nxdplug.runtime.sampling_params:prepare_sampling_params",
        "validate_sampling_params": "nxdplug.runtime.sampling_params:validate_sampling_params",
        "infer_sampling_params": "nxdplug.runtime.sampling_params:infer_sampling_params",
    },
)
