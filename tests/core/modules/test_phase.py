"""current_phase(): modules inside a model see which sub-model runs them, eager and traced."""

from __future__ import annotations

import pytest
import torch

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained
from nxdplug.errors import NxdPlugError
from nxdplug.modules.step import current_phase

SETTINGS = {"torch_dtype": "float32", "batch_size": 1, "seq_len": 32, "max_context_length": 8}


def test_outside_a_sub_model_there_is_no_phase() -> None:
    with pytest.raises(NxdPlugError, match="no phase is running"):
        current_phase()


def test_each_sub_model_runs_its_modules_in_its_own_phase(tiny_checkpoint) -> None:
    app = from_pretrained(tiny_checkpoint("llama"), NeuronConfig(**SETTINGS))
    app.to_cpu()
    seen = []
    norm = app.context_encoding_model.model.norm
    norm.register_forward_hook(lambda *_: seen.append(current_phase()))
    HuggingFaceGenerationAdapter(app).generate(
        torch.tensor([[5, 6, 7]]), max_new_tokens=3, eos_token_id=None
    )
    assert [(p.tag, p.is_context_encoding) for p in seen] == [
        ("context_encoding_model", True),
        ("token_generation_model", False),
        ("token_generation_model", False),
    ]
