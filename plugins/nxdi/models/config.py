"""NxD Inference's ``models.config``: the config classes."""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(
    __name__,
    {
        name: f"nxdplug.config:{name}"
        for name in (
            "BlockwiseMatmulConfig",
            "ChunkedPrefillConfig",
            "FusedSpecNeuronConfig",
            "HybridShardingConfig",
            "InferenceConfig",
            "LoraServingConfig",
            "MoENeuronConfig",
            "NeuronConfig",
            "OnDeviceSamplingConfig",
            "RouterConfig",
            "to_torch_dtype",
        )
    },
)
