"""The compiled modes in float32 give HF transformers' greedy tokens exactly, with several
buckets per phase (quantized: one; bfloat16 is in test_low_precision_parity.py; frozen weights
give the eager tokens in test_compile.py)."""

from __future__ import annotations

import pytest

from nxdplug.testing import check_accuracy
from tests.models.test_low_precision_parity import STEPS, loaded, prompts, quantized


@pytest.mark.slow
def test_compiled_float32_gives_hf_greedy_tokens(tiny_checkpoint, tmp_path) -> None:
    checkpoint = tiny_checkpoint("llama", seed=3)
    app = loaded(checkpoint, "float32", "compiled", tmp_path / "compiled")
    hf = app.load_hf_model(checkpoint).eval()
    report = check_accuracy(app, hf, *prompts(3), max_new_tokens=STEPS)
    assert report.passed, report.summary()


@pytest.mark.slow
def test_compiled_quantized_float32_gives_hf_greedy_tokens_on_its_weights(
    tiny_checkpoint, tmp_path
) -> None:
    """int8 weights in float32: HF transformers on the dequantized weights picks the same
    tokens."""
    app, reference = quantized(tiny_checkpoint("llama", seed=6), "float32", tmp_path)
    hf = app.load_hf_model(reference).eval()
    report = check_accuracy(app, hf, *prompts(6), max_new_tokens=STEPS)
    assert report.passed, report.summary()
