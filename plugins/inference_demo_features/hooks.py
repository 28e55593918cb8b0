"""The flags of NxD Inference's ``inference_demo`` that set up a feature (LoRA adapters, on-device
sampling, the fp8 KV cache, quantization, Medusa, EAGLE), for ``nxdplug inference_demo``.

The core adds the flags named after NeuronConfig attributes and those of the demo itself; the
flags here build a feature's sub-config (``--enable-lora`` ... make ``lora_config``), or are
accepted for the values the feature implements and refused, one line naming them, otherwise.
The features themselves stay with their plugins, which these flags only configure.
"""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.hookspecs import hookimpl
from nxdplug.types import CliExtension

NXDPLUG_API_VERSION = 1


@hookimpl
def nxdplug_cli_extensions() -> Iterable[CliExtension]:
    yield CliExtension(
        name="inference-demo-features",
        implementation="nxdplug.plugins.inference_demo_features.cli:FeatureFlags",
        commands=("inference_demo",),
        description="inference_demo's LoRA, on-device sampling, KV-cache quantization, "
        "quantization, Medusa and EAGLE flags",
    )
