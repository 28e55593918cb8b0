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
from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
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
from nxdplug.errors import CheckpointError, ConfigError
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
# What nxdplug holds each scheme as: (quantization_dtype, quantization_type, zero points held),
# None: dequantized.
HELD = {
    "int4-group32": ("int4", "blockwise_symmetric", False),
    "int4-channel": ("int4", "per_channel_symmetric", False),
    "int8-channel": ("int8", "per_channel_symmetric", False),
    "int8-tensor": ("int8", "per_tensor_symmetric", False),
    "fp8-channel": ("f8e4m3", "per_channel_symmetric", False),
    # Zero points go to the int4 kernel's (quantization_type names the granularity).
    "int4-asymmetric": ("int4", "blockwise_symmetric", True),
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
    dtype, granularity, zero_points = HELD[scheme]
    assert neuron_config.quantized and neuron_config.quantized_checkpoints_path == str(path)
    assert (neuron_config.quantization_dtype, neuron_config.quantization_type) == (
        dtype,
        granularity,
    )
    assert bool(getattr(neuron_config, "quantization_zero_points", None)) == zero_points
    assert neuron_config.modules_to_not_convert == ["lm_head"]
    down = app.context_encoding_model.model.layers[0].mlp.down_proj
    assert isinstance(down.weight_method, Int4Weight if dtype == "int4" else QuantizedWeight)
    # Symmetric int4 weights hold no zero points.
    assert hasattr(down, "weight_zero_point") == zero_points
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
    # Symmetric weights: the layers hold no zero points.
    with pytest.raises(ConfigError, match="quantization_zero_points=True contradicts"):
        from_pretrained(path, NeuronConfig(quantization_zero_points=True, **SETTINGS))


def test_a_format_no_plugin_reads_is_refused_by_name(checkpoint, tmp_path) -> None:
    folder = derived_checkpoint(checkpoint, tmp_path / "bnb")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="'bitsandbytes', which no installed plugin reads"):
        from_pretrained(folder, NeuronConfig(**SETTINGS))


# -- GPTQ, AWQ and block-scaled FP8 ------------------------------------------------------------
# Their tools (GPTQModel, AutoAWQ, DeepSeek's) need a GPU build of torch, so the checkpoints are
# written here in their documented layouts from values quantized here; the oracle is
# transformers on the weights those values stand for (and, for AWQ, compressed-tensors' own AWQ
# converter; for FP8, transformers reading the folder itself, which it dequantizes on a CPU).

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_groups(weight: torch.Tensor, g_idx: torch.Tensor, symmetric: bool):
    """Unsigned 4-bit ``(Q [in, out], Z [groups, out], S [groups, out])`` of a [out, in] weight,
    min-max per group (the groups of the input features given by ``g_idx``)."""
    groups = int(g_idx.max()) + 1
    q = torch.empty(weight.shape[1], weight.shape[0], dtype=torch.int64)
    zeros = torch.empty(groups, weight.shape[0], dtype=torch.int64)
    scales = torch.empty(groups, weight.shape[0])
    for group in range(groups):
        columns = (g_idx == group).nonzero().flatten()
        part = weight[:, columns]
        if symmetric:
            scale = part.abs().amax(dim=1) / 7.5
            zero = torch.full_like(scale, 8, dtype=torch.int64)
        else:
            low, high = part.amin(dim=1).clamp(max=0), part.amax(dim=1).clamp(min=0)
            scale = (high - low) / 15
            zero = (-low / scale).round().long().clamp(0, 15)
        scale = scale.half().float()  # as the tools store them
        q[columns] = ((part / scale[:, None]).round().long() + zero[:, None]).clamp(0, 15).T
        zeros[group], scales[group] = zero, scale
    return q, zeros, scales


def pack_words(values: torch.Tensor, dim: int, order=range(8)) -> torch.Tensor:
    """Eight 4-bit values to an int32 along ``dim``, value ``order[n]`` of each eight in
    nibble n (GPTQ packs in order, AWQ in its own)."""
    values = values if dim == 1 else values.T
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for nibble, index in enumerate(order):
        words |= (values[:, index::8] & 0xF) << (4 * nibble)
    words = words.to(torch.int32)
    return words if dim == 1 else words.T.contiguous()


def write_quantized_checkpoint(source: Path, folder: Path, declared: dict, encode) -> dict:
    """``source`` with each layer projection replaced by ``encode(weight)``'s tensors; the
    weights they stand for, by checkpoint key."""
    stand_for = {}

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if k.rpartition(".")[0].endswith(PROJECTIONS)]:
            module = key.removesuffix(".weight")
            encoded, dense = encode(tensors.pop(key).float())
            tensors.update({f"{module}.{name}": t for name, t in encoded.items()})
            stand_for[key] = dense

    derived_checkpoint(source, folder, edit=edit)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": declared}))
    return stand_for


def gptq_encoder(group: int, symmetric: bool, act_order: bool, v2: bool):
    def encode(weight: torch.Tensor):
        in_features = weight.shape[1]
        size = group if group > 0 else in_features
        order = torch.randperm(in_features, generator=torch.Generator().manual_seed(1))
        g_idx = torch.empty(in_features, dtype=torch.int64)
        g_idx[order if act_order else torch.arange(in_features)] = torch.arange(in_features) // size
        q, zeros, scales = quantize_groups(weight, g_idx, symmetric)
        dense = (q.T - zeros[g_idx].T) * scales[g_idx].T
        stored_zeros = zeros if v2 else zeros - 1  # the original format: zero points minus one
        encoded = {
            "qweight": pack_words(q, dim=0),
            "qzeros": pack_words(stored_zeros, dim=1),
            "scales": scales.half(),
            "g_idx": g_idx.to(torch.int32),
        }
        return encoded, dense

    return encode


GPTQ_CASES = {  # (group_size, sym, desc_act, checkpoint_format), held as int4
    "sym-g32": (32, True, False, "gptq", True),
    "asym-g32": (32, False, False, "gptq", True),
    "asym-channel-v2": (-1, False, False, "gptq_v2", True),
    "asym-g32-desc-act": (32, False, True, "gptq", False),
}


@pytest.mark.parametrize("case", GPTQ_CASES)
def test_gptq_checkpoints_load_as_the_weights_they_stand_for(
    checkpoint, tmp_path, case, caplog
) -> None:
    group, symmetric, act_order, checkpoint_format, held = GPTQ_CASES[case]
    declared = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "sym": symmetric,
        "desc_act": act_order,
        "checkpoint_format": checkpoint_format,
    }
    encode = gptq_encoder(group, symmetric, act_order, checkpoint_format == "gptq_v2")
    dense = write_quantized_checkpoint(checkpoint, tmp_path / "gptq", declared, encode)
    with caplog.at_level(logging.INFO, logger="nxdplug.quantization"):
        app = application(tmp_path / "gptq")
    down = app.context_encoding_model.model.layers[0].mlp.down_proj
    assert isinstance(down.weight_method, Int4Weight) == held == app.config.neuron_config.quantized
    # Zero points are held for asymmetric weights only (symmetric GPTQ stores 8: none held).
    assert hasattr(down, "weight_zero_point") == (held and not symmetric)
    # Activation-ordered groups are not held as stored: their weights are dequantized.
    assert ("dequantized to full precision at load" in caplog.text) == (not held)
    twin = derived_checkpoint(checkpoint, tmp_path / "twin", edit=lambda t: t.update(dense))
    assert_generates_as(app, twin)


def test_a_gptq_checkpoint_said_symmetric_with_zero_points_is_refused(checkpoint, tmp_path):
    """Zero points other than 8 (0 signed) in a checkpoint whose quantization_config says
    ``sym: true``: the layers, made symmetric from the config before the weights are read,
    hold none, and the load names the tensor and the setting."""
    declared = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True}
    declared |= {"desc_act": False, "checkpoint_format": "gptq_v2"}
    encode = gptq_encoder(32, symmetric=False, act_order=False, v2=True)
    write_quantized_checkpoint(checkpoint, tmp_path / "gptq", declared, encode)
    app = from_pretrained(tmp_path / "gptq", NeuronConfig(**SETTINGS))
    with pytest.raises(
        CheckpointError,
        match=r"layers\.\d\.\w+\.\w+\.weight_zero_point, .* and 11 more hold zero points other "
        "than 0 .* quantization_zero_points is not set",
    ):
        app.to_cpu()


def awq_encoder(group: int):
    def encode(weight: torch.Tensor):
        g_idx = torch.arange(weight.shape[1]) // group
        q, zeros, scales = quantize_groups(weight, g_idx, symmetric=False)
        encoded = {
            "qweight": pack_words(q, dim=1, order=AWQ_ORDER),
            "qzeros": pack_words(zeros, dim=1, order=AWQ_ORDER),
            "scales": scales.half(),
        }
        return encoded, (q.T - zeros[g_idx].T) * scales[g_idx].T

    return encode


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's: nibble n holds column AWQ_ORDER[n] of eight


def test_awq_checkpoints_load_as_compressed_tensors_converts_them(checkpoint, tmp_path) -> None:
    declared = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True}
    declared |= {"version": "gemm"}
    dense = write_quantized_checkpoint(checkpoint, tmp_path / "awq", declared, awq_encoder(32))
    app = application(tmp_path / "awq")
    down = app.context_encoding_model.model.layers[0].mlp.down_proj
    assert isinstance(down.weight_method, Int4Weight) and hasattr(down, "weight_zero_point")
    assert app.config.neuron_config.quantization_zero_points
    # compressed-tensors' converter of AutoAWQ checkpoints reads the same weights.
    converter = AutoAWQConverter.from_autoawq_config(declared)
    scheme = converter._build_quant_config().config_groups["config_group_0"]
    converted = converter.process(load_file(tmp_path / "awq" / "model.safetensors"))
    modules = {k.removesuffix(".weight_packed") for k in converted if k.endswith("_packed")}
    for module in modules:
        parts = {name: converted[f"{module}.{name}"] for name in PARTS}
        weight = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
        # It computes in the scales' float16: the same weights, rounded once.
        torch.testing.assert_close(weight, dense[f"{module}.weight"].half(), rtol=0, atol=0)
    twin = derived_checkpoint(checkpoint, tmp_path / "twin", edit=lambda t: t.update(dense))
    assert_generates_as(app, twin)


def fp8_block_encoder(block: int):
    def encode(weight: torch.Tensor):
        rows, features = weight.shape
        blocks = weight.reshape(rows // block, block, features // block, block)
        scale = blocks.abs().amax(dim=(1, 3)) / 448
        expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        quantized = (weight / expanded).to(torch.float8_e4m3fn)
        encoded = {"weight": quantized, "weight_scale_inv": scale}
        return encoded, quantized.float() * expanded

    return encode


def test_block_scaled_fp8_is_dequantized_at_load_as_transformers_does(
    checkpoint, tmp_path, caplog
) -> None:
    """transformers dequantizes these on a CPU too (FineGrainedFP8, no GPU): same logits."""
    declared = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    declared |= {"activation_scheme": "dynamic", "fmt": "e4m3"}
    path = tmp_path / "fp8"
    dense = write_quantized_checkpoint(checkpoint, path, declared, fp8_block_encoder(32))
    with caplog.at_level(logging.INFO, logger="nxdplug.quantization"):
        app = application(path)
    assert not app.config.neuron_config.quantized
    assert "FP8 checkpoint: layers.0.mlp.down_proj" in caplog.text
    assert_generates_as(app, path)
    twin = derived_checkpoint(checkpoint, tmp_path / "twin", edit=lambda t: t.update(dense))
    assert_generates_as(app, twin)
