"""``get_generate_outputs``: NxD Inference's helper that tokenizes prompts, generates, decodes.

Scripts from the NxD Inference feature guide (draft-model and fused speculation) call it; with
``draft_model`` the draft application is passed to ``generate()`` as ``assistant_model``.
"""

from __future__ import annotations

from typing import Any

import torch

from nxdplug.runtime.generation import HuggingFaceGenerationAdapter


def get_generate_outputs(
    model: Any,
    prompts: list[str],
    tokenizer: Any,
    is_hf: bool = False,
    draft_model: Any = None,
    generation_config: Any = None,
    **generate_kwargs: Any,
) -> tuple[torch.Tensor, list[str]]:
    """``(output ids [batch, prompt + new], decoded texts)`` of ``model`` on ``prompts``.

    ``is_hf``: ``model`` is a transformers model (its own ``generate``); otherwise an nxdplug
    application, wrapped in a HuggingFaceGenerationAdapter.
    """
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    inputs = tokenizer(prompts, padding=True, return_tensors="pt")
    if draft_model is not None:
        generate_kwargs["assistant_model"] = draft_model
    generator = model if is_hf else HuggingFaceGenerationAdapter(model)
    outputs = generator.generate(
        inputs.input_ids,
        attention_mask=inputs.attention_mask,
        generation_config=generation_config,
        **generate_kwargs,
    )
    texts = tokenizer.batch_decode(
        outputs, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    return outputs, texts
