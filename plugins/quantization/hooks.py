"""Weight quantization: int8, f8e4m3 and f8e5m2, per tensor or per output channel, and int4 per
output channel or blockwise (groups of input features), all symmetric as quantized here; other
tools' asymmetric int4 weights load with ``quantization_zero_points=True``.

``NeuronConfig(quantized=True, quantized_checkpoints_path=..., quantization_dtype=...,
quantization_type=...)`` switches it on. ``save_quantized_state_dict`` writes the checkpoint
with the method record ``<dtype>-<per_tensor|per_channel|blockwise>``; loading gives the
projections (:mod:`.targets` says which, less ``modules_to_not_convert``) weight methods that keep
the quantized weights in memory: on the CPU, int8 weights go to the plugin's int8 matmul
(:mod:`.kernel`), int4 weights to its int4 matmul (:mod:`.int4`); each reads the weight in its
bits when decoding and dequantizes it a panel at a time in the cache for prompts. fp8 weights and
other devices dequantize per call. Compiled graphs stack the projections of one input into one
call of either matmul (``nxdplug_stackable_linears``, a hook of the inductor backend).
f8e4m3 needs ``XLA_HANDLE_SPECIAL_SCALAR=1`` on Neuron only; on the CPU nothing is needed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from nxdplug.plugin_api import (
    CliExtension,
    Feature,
    QuantizationMethod,
    QuantizedCheckpointFormat,
    StateDictConverter,
    hookimpl,
)

if TYPE_CHECKING:
    from nxdplug.plugins.inductor_backend.records import StackableLinear

NXDPLUG_API_VERSION = 2

PACKAGE = "nxdplug.plugins.quantization"

# (dtype, granularity, class in methods.py)
METHODS = (
    ("int8", "per_tensor", "Int8PerTensor"),
    ("int8", "per_channel", "Int8PerChannel"),
    ("f8e4m3", "per_tensor", "F8e4m3PerTensor"),
    ("f8e4m3", "per_channel", "F8e4m3PerChannel"),
    ("f8e5m2", "per_tensor", "F8e5m2PerTensor"),
    ("f8e5m2", "per_channel", "F8e5m2PerChannel"),
    ("int4", "per_channel", "Int4Quantizer"),
    ("int4", "blockwise", "Int4Quantizer"),
)
# NxD Inference's blockwise settings (input features per scale, and the axis they run along),
# and this plugin's: whether int4 weights are asymmetric, with zero points (methods.py).
SETTINGS = {
    "quantization_block_size": None,
    "quantization_block_axis": None,
    "quantization_zero_points": False,
}


SCALE_SPANS = {
    "per_tensor": "per tensor",
    "per_channel": "per output channel",
    "blockwise": "per quantization_block_size input features of a row (default 128)",
}


@hookimpl
def nxdplug_quantization_methods() -> Iterable[QuantizationMethod]:
    for dtype, granularity, implementation in METHODS:
        yield QuantizationMethod(
            name=f"{dtype}-{granularity}",
            dtype=dtype,
            granularity=granularity,
            implementation=f"{PACKAGE}.methods:{implementation}",
            description=f"symmetric {dtype} weights, one scale " + SCALE_SPANS[granularity],
        )


@hookimpl
def nxdplug_features() -> Iterable[Feature]:
    yield Feature(
        name="weight-quantization",
        enabled_by=("quantized",),
        validate=f"{PACKAGE}.validation:validate",
        transform_model=f"{PACKAGE}.layers:quantize_model",
        settings=SETTINGS,
        description="8-bit and int4 projection weights with their scales; int8 and int4 "
        "matmuls for decoding",
    )


@hookimpl
def nxdplug_state_dict_converters() -> Iterable[StateDictConverter]:
    yield StateDictConverter(
        name="quantized-weights",
        converter=f"{PACKAGE}.convert:fit_quantized_weights",
        enabled_by=("quantized",),
        order=200,
        description="weight_scale to the layers' layout; 8-bit dtypes and granularity checked",
    )


@hookimpl
def nxdplug_cli_extensions() -> Iterable[CliExtension]:
    yield CliExtension(
        name="quantization-inference-demo",
        implementation="nxdplug.plugins.quantization.demo_flags:QuantizationDemoFlags",
        commands=("inference_demo",),
        description="inference_demo's quantization flags (--quantize-clamp-bound, ...)",
    )


# Other tools' checkpoints, by config.json's quant_method: (record name, quant_method,
# reader in formats/, description).
FORMATS = (
    (
        "compressed-tensors",
        "compressed-tensors",
        "compressed_tensors:CompressedTensorsReader",
        "llm-compressor's checkpoints: int8, fp8 and packed int4 weights as they are; other "
        "schemes dequantized at load",
    ),
    (
        "gptq",
        "gptq",
        "gptq_awq:GptqReader",
        "GPTQModel / AutoGPTQ 4-bit checkpoints: int4 layers (with zero points when "
        "asymmetric); activation-ordered groups dequantized at load",
    ),
    ("awq", "awq", "gptq_awq:AwqReader", "AutoAWQ GEMM 4-bit checkpoints: int4 layers"),
    (
        "fp8-block",
        "fp8",
        "fp8_block:Fp8BlockReader",
        "block-scaled FP8 checkpoints (DeepSeek-V3, Qwen3 FP8): dequantized at load",
    ),
    ("mxfp4", "mxfp4", "mxfp4:Mxfp4Reader", "GPT-OSS's MXFP4 experts: dequantized at load"),
)


@hookimpl
def nxdplug_quantized_checkpoint_formats() -> Iterable[QuantizedCheckpointFormat]:
    for name, method, reader, description in FORMATS:
        yield QuantizedCheckpointFormat(
            name=name,
            quant_methods=(method,),
            reader=f"{PACKAGE}.formats.{reader}",
            description=description,
        )


@hookimpl(optionalhook=True)  # a hook of the inductor backend
def nxdplug_stackable_linears() -> Iterable[StackableLinear]:
    """The int8 and int4 matmuls: compiled graphs stack Q, K and V (gate and up) into one call,
    as they do bf16 weights. Both hold weights (and int4 scales and zero points) in tiles of
    four rows; an int8 weight stacks with per-row scales only (a per-tensor scale is one)."""
    from nxdplug.plugins.inductor_backend.records import StackableLinear

    yield StackableLinear(
        name="int8-matmul",
        operator="nxdplug_quantization::int8_matmul",
        row_arguments=(1, 2),  # weight, scale
        row_multiple=4,
        description="int8_matmul(x, weight, scale)",
    )
    yield StackableLinear(
        name="int4-matmul",
        operator="nxdplug_int4::int4_matmul",
        row_arguments=(1, 2, 3),  # packed weight, scales, zero points (or None)
        row_multiple=4,
        description="int4_matmul(x, packed, scales, zero_points, group)",
    )
