"""Every shipped mode in bfloat16 against HF transformers directly, several buckets per phase
(frozen + autotuned: one per phase, its compile being the longest by far, ~19 s a graph):
no further from HF float32 than HF's own bfloat16 (``check_low_precision``: max and mean logit
error within 1.25x of HF's, greedy choices no worse), per seed. Modes: eager, compiled (the
default inductor mode, weights shared by the graphs), frozen (``freezing=true``) and frozen +
autotuned (the README's fastest mode). float32 is in test_float32_parity.py.
"""

from __future__ import annotations

import pytest

from nxdplug import NeuronConfig, from_pretrained
from nxdplug.testing import check_low_precision, random_prompts

BUCKETS = {
    "enable_bucketing": True,
    "context_encoding_buckets": [8, 16],
    "token_generation_buckets": [32, 64],
}
STEPS = 40  # prompts of 5 and 13 tokens: decoding crosses from the 32 to the 64 bucket
MODES = {
    "compiled": None,
    "frozen": "freezing=true",
    "frozen-autotuned": "freezing=true max_autotune=true",
}


def loaded(checkpoint, dtype: str, mode: str, folder):
    buckets = {"enable_bucketing": False} if mode == "frozen-autotuned" else BUCKETS
    config = NeuronConfig(
        batch_size=2, seq_len=64, max_context_length=16, torch_dtype=dtype, **buckets
    )
    app = from_pretrained(checkpoint, config)
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
@pytest.mark.parametrize(
    ("mode", "seed"), [("compiled", 0), ("frozen", 1), ("frozen-autotuned", 2)]
)
def test_compiled_bfloat16_is_as_close_to_float32_as_hf_bfloat16(
    tiny_checkpoint, tmp_path, mode, seed
) -> None:
    checkpoint = tiny_checkpoint("llama", seed=seed)
    app = loaded(checkpoint, "bfloat16", mode, tmp_path / "compiled")
    report = check_low_precision(app, checkpoint, *prompts(seed), max_new_tokens=STEPS)
    assert report.passed, report.summary()
