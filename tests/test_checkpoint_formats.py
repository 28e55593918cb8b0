"""Quantized checkpoints other tools write, found from ``config.json``'s ``quantization_config``
as transformers finds them (``plugins/quantization/formats``).

The checkpoints are made here by the format's own library (compressed-tensors quantizes and
compresses a tiny random Llama, as llm-compressor does), and the oracle is transformers reading
the same folder: greedy tokens equal and logits within float32 rounding. Schemes nxdplug holds as
stored load into its quantized layers; the others are dequantized at load.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import ModelCompressor, PackedQuantizationCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained
from nxdplug.errors import ConfigError
from nxdplug.plugins.quantization.layers import Int4Weight, QuantizedWeight
from nxdplug.testing import derived_checkpoint, random_prompts

PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
SETTINGS = {"batch_size": 2, "seq_len": 64, "max_context_length": 32, "torch_dtype": "float32"}

SCHEMES = {
    "int4-group32": (
        {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
        "pack-quantized",
    ),
    "int4-channel": ({"num_bits": 4, "type": "int", "strategy": "channel"}, "pack-quantized"),
    "int8-channel": ({"num_bits": 8, "type": "int", "strategy": "channel"}, "int-quantized"),
    "int8-tensor": ({"num_bits": 8, "type": "int", "strategy": "tensor"}, "int-quantized"),
    "fp8-channel": ({"num_bits": 8, "type": "float", "strategy": "channel"}, "float-quantized"),
    "int8-asymmetric": (
        {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": False},
        "int-quantized",
    ),
    "int4-asymmetric": (
        {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False},
        "pack-quantized",
    ),
}
# What nxdplug holds each scheme as: (quantization_dtype, quantization_type), None: dequantized.
HELD = {
    "int4-group32": ("int4", "blockwise_symmetric"),
    "int4-channel": ("int4", "per_channel_symmetric"),
    "int8-channel": ("int8", "per_channel_symmetric"),
    "int8-tensor": ("int8", "per_tensor_symmetric"),
    "fp8-channel": ("f8e4m3", "per_channel_symmetric"),
    # Zero points go to the int4 kernel's (quantization_type names the granularity).
    "int4-asymmetric": ("int4", "blockwise_symmetric"),
    "int8-asymmetric": None,
}
# transformers 5.24 cannot load this one (it sizes the packed zero points as unpacked).
HF_CANNOT_LOAD = {"int4-asymmetric"}


def compressed(source: Path, folder: Path, scheme: str) -> Path:
    """``source`` quantized (min-max scales, as llm-compressor's default observer) and
    compressed by compressed-tensors, ``lm_head`` left in full precision."""
    weights, fmt = SCHEMES[scheme]
    args = QuantizationArgs(**weights)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["lm_head"],
    )
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        weight = module.weight.data
        if args.strategy == "group":
            grouped = weight.reshape(weight.shape[0], -1, args.group_size)
            low, high = grouped.amin(-1), grouped.amax(-1)
        elif args.strategy == "channel":
            low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
        else:
            low, high = weight.amin().reshape(1), weight.amax().reshape(1)
        scale, zero_point = calculate_qparams(low, high, args)
        module.weight_scale.data = scale.reshape(module.weight_scale.shape)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero_point.reshape(module.weight_zero_point.shape).to(
                module.weight_zero_point.dtype
            )
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    return folder


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", seed=4, initializer_range=0.15)


@pytest.fixture(scope="module")
def formats(checkpoint, tmp_path_factory):
    built: dict[str, Path] = {}

    def build(scheme: str) -> Path:
        if scheme not in built:
            built[scheme] = compressed(checkpoint, tmp_path_factory.mktemp(scheme), scheme)
        return built[scheme]

    return build


def application(path: Path, **options):
    app = from_pretrained(path, NeuronConfig(**(SETTINGS | options)))
    app.to_cpu()
    return app


GENERATION = {
    "do_sample": False,
    "max_new_tokens": 10,
    "eos_token_id": None,
    "output_logits": True,
    "return_dict_in_generate": True,
}


def assert_generates_as(app, hf_path: Path) -> None:
    """Greedy tokens equal transformers' on ``hf_path``, logits within float32 rounding."""
    hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    input_ids, mask = random_prompts(256, (5, 11), seed=7)
    out = HuggingFaceGenerationAdapter(app).generate(input_ids, attention_mask=mask, **GENERATION)
    with torch.inference_mode():
        expected = hf.generate(input_ids, attention_mask=mask, pad_token_id=0, **GENERATION)
    assert torch.equal(out.sequences, expected.sequences)
    assert len(set(out.sequences[0, -10:].tolist())) > 3, "greedy output barely varies"
    torch.testing.assert_close(
        torch.stack(out.logits), torch.stack(expected.logits), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("scheme", [s for s, held in HELD.items() if held])
def test_compressed_tensors_schemes_load_as_stored_and_generate_as_transformers(
    formats, checkpoint, tmp_path, scheme
) -> None:
    path = formats(scheme)
    app = application(path)
    neuron_config = app.config.neuron_config
    dtype, granularity = HELD[scheme]
    assert neuron_config.quantized and neuron_config.quantized_checkpoints_path == str(path)
    assert (neuron_config.quantization_dtype, neuron_config.quantization_type) == (
        dtype,
        granularity,
    )
    assert neuron_config.modules_to_not_convert == ["lm_head"]
    down = app.context_encoding_model.model.layers[0].mlp.down_proj
    assert isinstance(down, Int4Weight if dtype == "int4" else QuantizedWeight)
    oracle = decompressed_twin(path, checkpoint, tmp_path) if scheme in HF_CANNOT_LOAD else path
    assert_generates_as(app, oracle)


def decompressed_twin(path: Path, checkpoint: Path, folder: Path) -> Path:
    """``checkpoint`` with the weights compressed-tensors decompresses from ``path``."""
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(config["config_groups"]["group_0"])
    stored = load_file(path / "model.safetensors")
    modules = {k.removesuffix(".weight_packed") for k in stored if k.endswith(".weight_packed")}
    decompressed = {
        f"{module}.weight": PackedQuantizationCompressor.decompress(
            {name: stored[f"{module}.{name}"] for name in PARTS}, scheme
        )["weight"]
        for module in modules
    }
    return derived_checkpoint(checkpoint, folder / "twin", edit=lambda t: t.update(decompressed))


def test_a_scheme_without_a_layer_is_dequantized_at_load_and_said(formats, caplog) -> None:
    path = formats("int8-asymmetric")
    with caplog.at_level(logging.INFO, logger="nxdplug.quantization"):
        app = application(path)
    assert not app.config.neuron_config.quantized
    assert "dequantized to full precision at load" in caplog.text
    assert_generates_as(app, path)


def test_settings_that_contradict_the_checkpoint_are_refused(formats, tmp_path) -> None:
    path = formats("int4-group32")
    with pytest.raises(ConfigError, match=r"quantized_checkpoints_path=.* contradicts"):
        from_pretrained(path, NeuronConfig(quantized_checkpoints_path=str(tmp_path), **SETTINGS))
    with pytest.raises(ConfigError, match="quantization_block_size=64 contradicts"):
        from_pretrained(path, NeuronConfig(quantization_block_size=64, **SETTINGS))


def test_a_format_no_plugin_reads_is_refused_by_name(checkpoint, tmp_path) -> None:
    folder = derived_checkpoint(checkpoint, tmp_path / "bnb")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="'bitsandbytes', which no installed plugin reads"):
        from_pretrained(folder, NeuronConfig(**SETTINGS))
