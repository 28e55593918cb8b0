"""The config checks of weight quantization (``quantized=True``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from importlib.util import find_spec
from typing import TYPE_CHECKING

from nxdplug.plugin_api import QuantizationMethod, requested_backend
from nxdplug.plugins.quantization.methods import ZERO_POINTS_SETTING

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, NeuronConfig, PipelineContext

SPECIAL_SCALAR_ENV = "XLA_HANDLE_SPECIAL_SCALAR"


def validate(context: PipelineContext) -> list[str]:
    """The ``validate`` callback of the weight-quantization feature."""
    return list(quantization_problems(context.config))


def method_problems(neuron_config: NeuronConfig) -> Iterator[str]:
    """``quantization_dtype`` and ``quantization_type`` against the registered methods (a
    third-party method's dtype is as good as a built-in one)."""
    from nxdplug.plugin_api import did_you_mean, get_registry

    methods = get_registry().records("quantization_methods")
    allowed = {
        "quantization_dtype": tuple(dict.fromkeys(m.dtype for m in methods)),
        "quantization_type": tuple(dict.fromkeys(f"{m.granularity}_symmetric" for m in methods)),
    }
    unknown = False
    for name, choices in allowed.items():
        value = getattr(neuron_config, name)
        if value not in choices:
            unknown = True
            listing = ", ".join(repr(choice) for choice in choices)
            hint = did_you_mean(str(value), choices)
            yield f"{name} is {value!r}{hint}; choose one of {listing}"
    pairs = {m.name: m for m in methods}
    if not unknown and QuantizationMethod.name_for(neuron_config) not in pairs:
        dtype = neuron_config.quantization_dtype
        types = [f"{m.granularity}_symmetric" for m in methods if m.dtype == dtype]
        yield (
            f"quantization_dtype={dtype!r} comes with quantization_type "
            f"{' or '.join(map(repr, types))}, not {neuron_config.quantization_type!r}"
        )


def int4_problems(neuron_config: NeuronConfig) -> Iterator[str]:
    """int4's block settings, and what it does not combine with yet."""
    block_size = getattr(neuron_config, "quantization_block_size", None)
    axis = getattr(neuron_config, "quantization_block_axis", None)
    if block_size is not None and not (isinstance(block_size, int) and block_size % 32 == 0):
        yield (
            f"quantization_block_size is {block_size!r}; int4 blocks are a multiple of 32 input "
            "features (32, 64, 128 or 256 run as they are on the CPU)"
        )
    if axis not in (None, 1, -1):
        yield (
            f"quantization_block_axis is {axis!r}; int4 blocks run along the input features "
            "(axis 1)"
        )
    if neuron_config.tp_degree > 1:
        yield (
            f"int4 weights with tp_degree={neuron_config.tp_degree}: not implemented yet (the "
            "packed columns and block scales are not split over ranks); use tp_degree=1 or int8"
        )
    if neuron_config.lora_config is not None:
        yield "int4 weights with multi-LoRA: not implemented yet; use int8 weights with LoRA"


def zero_point_problems(neuron_config: NeuronConfig) -> Iterator[str]:
    """``quantization_zero_points``: a bool, and for int4 weights only."""
    zero_points = getattr(neuron_config, ZERO_POINTS_SETTING, None)
    if zero_points is not None and not isinstance(zero_points, bool):
        yield (
            f"{ZERO_POINTS_SETTING} is {zero_points!r}; give True (asymmetric int4 weights, "
            "with a zero point per group) or False"
        )
    elif zero_points and neuron_config.quantization_dtype != "int4":
        yield (
            f"{ZERO_POINTS_SETTING}=True with quantization_dtype="
            f"{neuron_config.quantization_dtype!r}: only int4 layers hold zero points; unset it"
        )


def quantization_problems(config: InferenceConfig) -> Iterator[str]:
    """What stops a quantized config from loading. The checkpoint itself is not looked for:
    the guide builds the application before ``save_quantized_state_dict`` writes it, so a
    missing one is reported when the weights are read."""
    neuron_config = config.neuron_config
    yield from method_problems(neuron_config)
    if neuron_config.quantization_dtype == "int4":
        yield from int4_problems(neuron_config)
    yield from zero_point_problems(neuron_config)
    if not neuron_config.quantized_checkpoints_path:
        yield (
            "quantized=True needs quantized_checkpoints_path (where the quantized weights are, "
            "or will be saved by save_quantized_state_dict)"
        )
    skip = neuron_config.modules_to_not_convert
    if skip is not None and (
        isinstance(skip, str) or not all(isinstance(entry, str) for entry in skip)
    ):
        yield (
            f"modules_to_not_convert is {skip!r}; give a list of module names, such as "
            "['lm_head', 'layers.0.self_attn']"
        )
    if (
        neuron_config.quantization_dtype == "f8e4m3"
        and _targets_neuron(neuron_config)
        and os.environ.get(SPECIAL_SCALAR_ENV) != "1"
    ):
        # Only the Neuron compiler needs it; CPU backends handle float8_e4m3fn as it is.
        yield (
            f"quantization_dtype='f8e4m3' on Neuron needs the environment variable "
            f"{SPECIAL_SCALAR_ENV}=1; set it before compiling"
        )


def _targets_neuron(neuron_config: NeuronConfig) -> bool:
    requested = requested_backend(neuron_config)
    if requested is not None:
        return requested == "neuron"
    return find_spec("torch_neuronx") is not None
