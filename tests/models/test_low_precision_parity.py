"""Every shipped mode in bfloat16 against HF transformers directly, several buckets per phase
(frozen + autotuned: one per phase, its compile being the longest by far, ~19 s a graph;
quantized: one per phase too, the buckets being the compiled mode's, not the quantizer's):
no further from HF float32 than HF's own bfloat16 (``check_low_precision``: max and mean logit
error within 1.25x of HF's, greedy choices no worse), per seed. Modes: eager, compiled (the
default inductor mode, weights shared by the graphs, linear weights prepacked), frozen +
autotuned (``freezing=true`` alone gives the eager float32 tokens in test_compile.py), and
compiled with int8 weight-only quantization (HF then runs on the dequantized weights: the float
model the quantized one stands for). float32 is in test_float32_parity.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nxdplug import NeuronConfig, from_pretrained
from nxdplug.checkpoint.state_dict import load_tensor_file
from nxdplug.plugins.quantization.methods import dequantize_weight
from nxdplug.testing import check_low_precision, derived_checkpoint, random_prompts

BUCKETS = {
    "enable_bucketing": True,
    "context_encoding_buckets": [8, 16],
    "token_generation_buckets": [32, 64],
}
STEPS = 40  # prompts of 5 and 13 tokens: decoding crosses from the 32 to the 64 bucket
MODES = {
    "compiled": None,
    "frozen-autotuned": "freezing=true max_autotune=true",
    "quantized": None,
}


def quantized_options(path: Path) -> dict:
    return {
        "quantized": True,
        "quantized_checkpoints_path": str(path),
        "quantization_dtype": "int8",
        "quantization_type": "per_channel_symmetric",
    }


def neuron_config(dtype: str, mode: str, **options) -> NeuronConfig:
    one_per_phase = mode in ("frozen-autotuned", "quantized")
    buckets = {"enable_bucketing": False} if one_per_phase else BUCKETS
    return NeuronConfig(
        batch_size=2, seq_len=64, max_context_length=16, torch_dtype=dtype, **buckets, **options
    )


def loaded(checkpoint, dtype: str, mode: str, folder, **options):
    app = from_pretrained(checkpoint, neuron_config(dtype, mode, **options))
    if mode == "eager":
        app.to_cpu()
        return app
    app.compiler_args = MODES[mode]
    app.compile(folder, quiet=True)
    app.load(folder, quiet=True)
    return app


def prompts(seed: int):
    return random_prompts(512, (5, 13), seed=seed)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_eager_bfloat16_is_as_close_to_float32_as_hf_bfloat16(tiny_checkpoint, seed) -> None:
    checkpoint = tiny_checkpoint("llama", seed=seed)
    app = loaded(checkpoint, "bfloat16", "eager", None)
    report = check_low_precision(app, checkpoint, *prompts(seed), max_new_tokens=STEPS)
    assert report.passed, report.summary()


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "seed"), [("compiled", 0), ("frozen-autotuned", 2)])
def test_compiled_bfloat16_is_as_close_to_float32_as_hf_bfloat16(
    tiny_checkpoint, tmp_path, mode, seed
) -> None:
    checkpoint = tiny_checkpoint("llama", seed=seed)
    app = loaded(checkpoint, "bfloat16", mode, tmp_path / "compiled")
    report = check_low_precision(app, checkpoint, *prompts(seed), max_new_tokens=STEPS)
    assert report.passed, report.summary()


def quantized(checkpoint: Path, dtype: str, folder: Path):
    """(the int8 per-channel model of ``checkpoint``, compiled and loaded in ``dtype``; an HF
    checkpoint of its dequantized weights)."""
    options = quantized_options(folder / "int8.safetensors")
    unloaded = from_pretrained(checkpoint, neuron_config(dtype, "quantized", **options))
    type(unloaded).save_quantized_state_dict(checkpoint, unloaded.config)
    int8 = load_tensor_file(folder / "int8.safetensors")

    def dequantize(tensors: dict[str, torch.Tensor]) -> None:
        for name, scale in int8.items():
            if name.endswith(".weight_scale"):
                weight = name.removesuffix("_scale")
                tensors[weight] = dequantize_weight(int8[weight], scale, torch.float32)

    reference = derived_checkpoint(checkpoint, folder / "dequantized", edit=dequantize)
    return loaded(checkpoint, dtype, "quantized", folder / "compiled", **options), reference


@pytest.mark.slow
def test_quantized_bfloat16_is_as_close_to_its_float32_weights_as_hf_bfloat16(
    tiny_checkpoint, tmp_path
) -> None:
    """int8 weights: a few rows (decoding) multiply by them in the plugin's int8 matmul
    (integer products, float32 scales), prompts of 12 rows and more by panels dequantized to
    bf16."""
    app, reference = quantized(tiny_checkpoint("llama", seed=5), "bfloat16", tmp_path)
    held = app.weight_tensors()
    assert next(t for n, t in held.items() if n.endswith("q_proj.weight")).dtype == torch.int8
    scale = next(t for n, t in held.items() if n.endswith("q_proj.weight_scale"))
    assert scale.dtype == torch.float32  # not the model's bf16 (the compiled folder's weights)
    report = check_low_precision(app, reference, *prompts(5), max_new_tokens=STEPS)
    assert report.passed, report.summary()
