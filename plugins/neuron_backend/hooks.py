"""The Neuron backend: torch-neuronx traces each graph to a NEFF inside a TorchScript module.

Written against torch-neuronx's documented ``trace`` API; torch-neuronx cannot be installed on
the machines this project is developed on, so this backend is untested. Where torch-neuronx is
missing, choosing it fails at once with what to install. NeuronConfig's NKI kernel switches
and compiler hints belong here too: the backend owns them (``owned_settings``), so another
backend reports them as having no effect, and the ``nki-kernels`` feature checks what the
kernels need of the rest of the config on any backend.
"""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import CompileBackend, Feature, hookimpl

NXDPLUG_API_VERSION = 2

# NeuronConfig's NKI kernel switches and the capability that runs them; kernels.py checks them.
CAPABILITY = "nki-kernels"
KERNEL_FLAGS = (
    "attn_kernel_enabled",
    "qkv_kernel_enabled",
    "mlp_kernel_enabled",
    "quantized_mlp_kernel_enabled",
    "rmsnorm_quantize_kernel_enabled",
)
# Compiler and runtime hints of NeuronConfig and MoENeuronConfig.
COMPILER_SETTINGS = (
    "logical_nc_config",
    "cc_pipeline_tiling_factor",
    "scratchpad_page_size",
    "weights_to_skip_layout_optimization",
    "use_index_calc_kernel",
    "blockwise_matmul_config",
)


@hookimpl
def nxdplug_compile_backends() -> Iterable[CompileBackend]:
    yield CompileBackend(
        name="neuron",
        implementation="nxdplug.plugins.neuron_backend.backend:NeuronBackend",
        priority=100,
        tp_degrees=(1, 2, 4, 8, 16, 24, 32, 64),
        capabilities={CAPABILITY},
        owned_settings=(*KERNEL_FLAGS, *COMPILER_SETTINGS),
        description="torch-neuronx trace to NEFF (Trainium / Inferentia); untested here",
    )


@hookimpl
def nxdplug_features() -> Iterable[Feature]:
    yield Feature(
        name="nki-kernels",
        enabled_by=KERNEL_FLAGS,
        validate="nxdplug.plugins.neuron_backend.kernels:validate",
        description="Neuron (NKI) kernels: what they need of the config (run by the neuron "
        "backend only)",
    )
