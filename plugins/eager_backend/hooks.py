"""The eager backend: sub-models run as plain PyTorch modules, what ``to_cpu()`` uses."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.hookspecs import hookimpl
from nxdplug.types import CompileBackend

NEURON_KERNEL_FLAGS = (
    "attn_kernel_enabled",
    "qkv_kernel_enabled",
    "mlp_kernel_enabled",
    "quantized_mlp_kernel_enabled",
    "rmsnorm_quantize_kernel_enabled",
)


@hookimpl
def nxdplug_compile_backends() -> Iterable[CompileBackend]:
    yield CompileBackend(
        name="eager",
        implementation="nxdplug.plugins.eager_backend.backend:EagerBackend",
        priority=0,
        description="plain PyTorch on the host (CPU, or CUDA tensors); no artefact",
    )


@hookimpl
def nxdplug_validate_config(config) -> Iterable[str]:
    neuron_config = config.neuron_config
    for flag in NEURON_KERNEL_FLAGS:
        if getattr(neuron_config, flag, False):
            yield (
                f"{flag}=True selects a Neuron (NKI) kernel, which the eager backend cannot run; "
                f"set {flag}=False or compile with the neuron backend"
            )
