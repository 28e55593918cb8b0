"""NeuronConfig's NKI kernel switches: they mean something to the neuron backend only.

The ``nki-kernels`` feature is enabled by any of them; its check reports the combinations the
kernels need, on any backend (the config must stay valid for the neuron backend). Another
backend reports the switches as without effect (the neuron backend owns them).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nxdplug.plugin_api import NeuronConfig, PipelineContext


def validate(context: PipelineContext) -> list[str]:
    """The ``validate`` callback of the ``nki-kernels`` feature."""
    return list(kernel_dependency_problems(context.neuron_config))


def kernel_dependency_problems(nc: NeuronConfig) -> Iterator[str]:
    """What each kernel needs of the rest of the config."""
    bf16 = nc.torch_dtype == torch.bfloat16
    dtype = str(nc.torch_dtype).removeprefix("torch.")
    if nc.qkv_kernel_enabled and not nc.fused_qkv:
        yield "qkv_kernel_enabled needs fused_qkv=True; set it, or disable the QKV kernel"
    if nc.qkv_kernel_enabled and not bf16:
        yield (
            f"qkv_kernel_enabled needs torch_dtype bfloat16 (it is {dtype}); change the dtype "
            "or disable the QKV kernel"
        )
    if nc.mlp_kernel_enabled and not bf16:
        yield (
            f"mlp_kernel_enabled needs torch_dtype bfloat16 (it is {dtype}); change the dtype "
            "or disable the MLP kernel"
        )
    if nc.quantized_mlp_kernel_enabled and not nc.mlp_kernel_enabled:
        yield "quantized_mlp_kernel_enabled needs mlp_kernel_enabled=True; set it too"
    if nc.rmsnorm_quantize_kernel_enabled and not nc.quantized_mlp_kernel_enabled:
        yield "rmsnorm_quantize_kernel_enabled needs quantized_mlp_kernel_enabled=True; set it too"
