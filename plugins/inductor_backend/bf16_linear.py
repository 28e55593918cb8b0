"""bf16 linears of compiled graphs by weights stored in panels (``bf16_linear.cpp``).

On an x86 CPU with AVX512-BF16, a bf16 linear weight that the graphs take prepacked is stored
in panels of 32 output features instead of oneDNN's layout: panel ``j`` holds rows
``32j .. 32j+31`` of the ``[out, in]`` weight, in-feature pairs outermost
(``[in / 2, 32, 2]``; the last panel as wide as the rows left), so that one 64-byte read gives
two in-features of 16 outputs, the operands of ``vdpbf16ps``. The stored tensor is 1-D, the
weight's values in that order (so that nobody takes it for the ``[out, in]`` matrix: copying a
matrix into it in place fails). The graphs call
``torch.ops.nxdplug_bf16_linear.linear`` for those linears (built by
:mod:`nxdplug.runtime.cpp_ops`); the kernel's source says why it is faster.

``NXDPLUG_BF16_LINEAR=onednn`` keeps oneDNN's linear for bf16 weights too (``panels``, the
default, uses panels where the CPU and the build allow).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nxdplug.plugin_api import NxdPlugError, build_operator

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

SOURCE = Path(__file__).with_name("bf16_linear.cpp")
LIBRARY = "nxdplug_bf16_linear"
SWITCH = "NXDPLUG_BF16_LINEAR"
PANEL = 32


@functools.cache
def bf16_linear_op() -> Any | None:
    """``linear(x [..., in] bf16, weight [out * in] bf16 in panels, bias [out] or None)`` ->
    ``[..., out]`` bf16, or None where the extension cannot be built."""
    return build_operator(
        LIBRARY,
        SOURCE,
        "linear",
        _output_shape,
        purpose="bf16 linear",
        instead="bf16 linears use oneDNN's prepacked weights instead, which is slower",
    )


def _output_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # a graph traces the op with the weight's declared [out, in] shape; it runs on the panels
    return x.new_empty((*x.shape[:-1], weight.numel() // x.shape[-1]))


def panels_chosen() -> bool:
    """False when SWITCH says ``onednn``; any other value but ``panels`` is refused."""
    choice = os.environ.get(SWITCH, "panels")
    if choice not in ("panels", "onednn"):
        raise NxdPlugError(f"{SWITCH}={choice!r}: expected 'panels' (the default) or 'onednn'")
    return choice == "panels"


@functools.cache
def _panels_usable() -> bool:
    op = bf16_linear_op()
    return op is not None and bool(torch.ops.nxdplug_bf16_linear.usable())


def panels_in_use() -> bool:
    """Whether bf16 weights of graphs compiled or loaded in this process take panels."""
    return panels_chosen() and _panels_usable()


def may_hold_bf16_weights(config: InferenceConfig) -> bool:
    """Whether the model of ``config`` (an InferenceConfig), or its fused draft, may have bf16
    linear weights: its dtype is bfloat16, or its weights keep their checkpoint's dtypes
    (``cast_type`` other than "config")."""
    configs = [config]
    fused = getattr(config, "fused_spec_config", None)
    if fused is not None and fused.draft_config is not None:
        configs.append(fused.draft_config)
    return any(
        c.neuron_config.torch_dtype == torch.bfloat16 or c.neuron_config.cast_type != "config"
        for c in configs
    )


def takes_panels(dtype: torch.dtype, shape: torch.Size | list[int]) -> bool:
    """Whether a linear weight of this dtype and shape is stored in panels here."""
    return dtype == torch.bfloat16 and len(shape) == 2 and shape[1] % 2 == 0 and panels_in_use()


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """The values of ``weight`` ``[out, in]`` in panel order, 1-D."""
    out_features, in_features = weight.shape
    full = out_features // PANEL * PANEL
    pairs = in_features // 2
    panels = weight[:full].reshape(-1, PANEL, pairs, 2).transpose(1, 2)
    last = weight[full:].reshape(-1, pairs, 2).transpose(0, 1)
    return torch.cat([panels.reshape(-1), last.reshape(-1)])
