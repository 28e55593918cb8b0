"""int4 weights (``quantization_dtype="int4"``, per output channel or blockwise).

The checkpoint packs 4-bit values as compressed-tensors does (checked against its own packer);
in memory they are in the plugin's int4 kernel layout
(``tests/plugins/quantization/test_int4_kernels.py``). The model is checked against HF
transformers running the dequantized weights: greedy tokens equal and logits within float32
rounding, through both the kernel (decoding) and the dequantized GEMM (prompts), with a last
group shorter than the others (``intermediate_size`` 176 in groups of 32). Accuracy on the
trained pycoder-tiny is in ``tests/plugins/quantization/test_quantization.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from torch import nn
from transformers import AutoModelForCausalLM

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained
from nxdplug.contrib_models.llama.modeling_llama import NeuronLlamaForCausalLM
from nxdplug.errors import ConfigError
from nxdplug.modules.parallel_linear import ColumnParallelLinear
from nxdplug.plugins.quantization.int4 import (
    from_kernel_layout,
    pack_int4,
    padded_features,
    quantize_int4,
    to_kernel_layout,
    unpack_int4,
)
from nxdplug.plugins.quantization.layers import Int4Weight, hold_int4
from nxdplug.plugins.quantization.memory import weight_memory
from nxdplug.testing import derived_checkpoint, random_prompts


@pytest.mark.parametrize(("rows", "columns", "group"), [(64, 256, 128), (48, 176, 32)])
def test_packing_is_compressed_tensors_and_the_kernel_layout_reads_back(rows, columns, group):
    weight = torch.randn(rows, columns, generator=torch.Generator().manual_seed(rows))
    q, scale = quantize_int4(weight, group)
    assert q.min() >= -8 and q.max() <= 7 and scale.shape == (rows, -(-columns // group))
    assert torch.equal(pack_int4(q), pack_to_int32(q, 4))
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    padded = padded_features(columns)
    kernel = to_kernel_layout(q, padded)
    assert kernel.shape == (rows, padded // 2)
    assert torch.equal(from_kernel_layout(kernel)[:, :columns], q)
    # Each value within half a step of its group's scale.
    steps = scale.repeat_interleave(group, dim=1)[:, :columns]
    assert ((weight - q * steps).abs() <= steps / 2 + 1e-6).all()


def int4_options(path: Path, granularity: str = "blockwise", **extra) -> dict:
    return {
        "quantized": True,
        "quantized_checkpoints_path": str(path),
        "quantization_dtype": "int4",
        "quantization_type": f"{granularity}_symmetric",
        **extra,
    }


SETTINGS = {"batch_size": 2, "seq_len": 64, "max_context_length": 32, "torch_dtype": "float32"}


def application(path: Path, **options):
    app = from_pretrained(path, NeuronConfig(**(SETTINGS | options)))
    app.to_cpu()
    return app


def quantized(checkpoint: Path, folder: Path, granularity: str = "blockwise", **extra) -> dict:
    """``checkpoint`` quantized to int4 into ``folder``; the options that load it."""
    options = int4_options(folder, granularity, **extra)
    config = from_pretrained(checkpoint, NeuronConfig(torch_dtype="float32", **options)).config
    NeuronLlamaForCausalLM.save_quantized_state_dict(checkpoint, config)
    return options


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", seed=2, intermediate_size=176, initializer_range=0.15)


def dequantized_twin(app, checkpoint: Path, folder: Path) -> Path:
    """``checkpoint`` with each int4 projection replaced by what the model multiplies by."""
    layers = {
        name: module
        for name, module in app.context_encoding_model.model.named_modules()
        if isinstance(getattr(module, "weight_method", None), Int4Weight)
    }

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for name, layer in layers.items():
            key = f"{name}.weight" if name == "lm_head" else f"model.{name}.weight"
            tensors[key] = layer.weight_method.dense_weight(layer, torch.float32)

    return derived_checkpoint(checkpoint, folder, edit=edit)


@pytest.mark.parametrize(
    ("granularity", "extra"),
    [("blockwise", {"quantization_block_size": 32}), ("per_channel", {})],
)
def test_int4_model_is_hf_on_its_dequantized_weights(checkpoint, tmp_path, granularity, extra):
    options = quantized(checkpoint, tmp_path / "int4", granularity, **extra)
    app = application(checkpoint, **options)
    hf_path = dequantized_twin(app, checkpoint, tmp_path / "dequantized")
    hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()

    input_ids, mask = random_prompts(512, (5, 12), seed=3)
    settings = {
        "attention_mask": mask,
        "do_sample": False,
        "max_new_tokens": 12,
        "eos_token_id": None,
        "output_logits": True,
        "return_dict_in_generate": True,
    }
    out = HuggingFaceGenerationAdapter(app).generate(input_ids, **settings)
    with torch.inference_mode():
        expected = hf.generate(input_ids, pad_token_id=0, **settings)
    assert torch.equal(out.sequences, expected.sequences)
    assert len(set(out.sequences[0, -12:].tolist())) > 3, "greedy output barely varies"
    torch.testing.assert_close(
        torch.stack(out.logits), torch.stack(expected.logits), rtol=1e-4, atol=1e-4
    )
    # The projections hold 4 bits a weight in the kernel's layout, and no zero points (the
    # quantizer writes symmetric weights).
    down = app.context_encoding_model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == torch.uint8 and down.weight.shape == (64, 256 // 2)
    assert not hasattr(down, "weight_zero_point")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"quantization_type": "per_tensor_symmetric"},
            "quantization_dtype='int4' comes with quantization_type 'per_channel_symmetric' "
            "or 'blockwise_symmetric'",
        ),
        ({"quantization_block_size": 100}, "a multiple of 32"),
        ({"quantization_block_axis": 0}, "axis 1"),
        ({"tp_degree": 2}, "tp_degree=2: not implemented yet"),
        ({"quantization_zero_points": "yes"}, "quantization_zero_points is 'yes'; give True"),
        (
            {
                "quantization_dtype": "int8",
                "quantization_type": "per_channel_symmetric",
                "quantization_zero_points": True,
            },
            "quantization_zero_points=True with quantization_dtype='int8': only int4 layers",
        ),
    ],
    ids=["quantization_type", "block size", "axis", "tensor parallel", "zero points", "int8"],
)
def test_int4_settings_are_checked(checkpoint, tmp_path, change, message) -> None:
    options = int4_options(tmp_path / "q")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        from_pretrained(checkpoint, NeuronConfig(torch_dtype="float32", **options | change))


@pytest.mark.parametrize("zero_points", [False, True])
def test_weight_memory_counts_the_packed_weights(zero_points) -> None:
    layer = hold_int4(ColumnParallelLinear(176, 64), group=32, zero_points=zero_points)
    memory = weight_memory(nn.ModuleDict({"proj": layer}))
    # 176 inputs held as 256 (whole blocks of 128), two to a byte, and a float16 scale per group
    # of each row (and an int8 zero point, for asymmetric weights); the dense count is the
    # 64 x 176 weights.
    assert memory.held == 64 * 256 // 2 + 64 * (256 // 32) * (2 + zero_points)
    assert memory.float32 == 4 * 64 * 176


def test_a_bfloat16_int4_model_holds_nibbles_and_float16_scales_only(checkpoint, tmp_path):
    """The weights of an int4 model in groups of 32, as this plugin quantizes them (symmetric):
    each projection's nibbles and float16 scales, no zero points; the rest in bfloat16."""
    options = quantized(checkpoint, tmp_path / "int4", quantization_block_size=32)
    app = application(checkpoint, **options | {"torch_dtype": "bfloat16"})
    memory = weight_memory(app.context_encoding_model.model)
    # The tiny Llama: hidden 64, 4 heads of 16 and 2 KV heads, intermediate 176, 2 layers,
    # vocabulary 512, untied head. Inputs are held in whole blocks of 128 (64 -> 128, 176 -> 256).
    layer = [(64, 64), (32, 64), (32, 64), (64, 64), (176, 64), (176, 64), (64, 176)]
    projections = 2 * layer + [(512, 64)]  # (out, in), the head last
    padded = {64: 128, 176: 256}
    nibbles = sum(out * padded[features] // 2 for out, features in projections)
    scales = sum(out * padded[features] // 32 * 2 for out, features in projections)
    bfloat16 = 2 * (512 * 64 + 2 * 2 * 64 + 64)  # the embedding and the norms
    assert memory.held == nibbles + scales + bfloat16


def test_the_zero_points_setting_shapes_the_compiled_graphs() -> None:
    """Layers with and without zero points take different parameters: a folder compiled for
    one kind is not reused for the other."""
    from nxdplug.compile.artefacts import graph_shaping_config

    def shaping(**zero_points) -> dict:
        neuron_config = NeuronConfig(**int4_options(Path("/q")), **zero_points)
        return graph_shaping_config({"neuron_config": neuron_config.to_dict()})

    assert shaping() != shaping(quantization_zero_points=True)


def test_a_compiled_int4_model_gives_the_eager_tokens(checkpoint, tmp_path) -> None:
    options = quantized(checkpoint, tmp_path / "int4", quantization_block_size=32)
    input_ids, mask = random_prompts(512, (7, 3), seed=5)
    settings = {"do_sample": False, "max_new_tokens": 8, "eos_token_id": None}
    eager = HuggingFaceGenerationAdapter(application(checkpoint, **options))
    expected = eager.generate(input_ids, attention_mask=mask, **settings)
    neuron_config = NeuronConfig(**SETTINGS, compile_backend="inductor", **options)
    from_pretrained(checkpoint, neuron_config).compile(tmp_path / "compiled", quiet=True)
    compiled = from_pretrained(checkpoint, neuron_config)
    compiled.load(tmp_path / "compiled", quiet=True)
    actual = HuggingFaceGenerationAdapter(compiled).generate(
        input_ids, attention_mask=mask, **settings
    )
    assert torch.equal(actual, expected)
