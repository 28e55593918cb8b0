"""One-call checks of a model plugin against HF transformers, on prompts made up for them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nxdplug.plugin_api import compare_with_hf

if TYPE_CHECKING:
    from nxdplug.plugin_api import AccuracyReport, NeuronConfig

check_accuracy = compare_with_hf
"""``model`` (an nxdplug causal LM, loaded) against ``hf_model`` by token or logit matching:
the check ``nxdplug run --check-accuracy-mode`` reports."""


def check_against_hf(
    model_path: str,
    neuron_config: NeuronConfig | None = None,
    *,
    prompts: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 32,
    mode: str = "token-matching",
    tolerance: tuple[float, float] | None = None,
) -> AccuracyReport:
    """One call for a plugin author's test: load ``model_path`` with nxdplug (the model plugin is
    chosen by the registry) and with HF transformers in the same dtype, and compare them.

    ``prompts`` default to two random prompts of different lengths (left-padded, ids from 1).
    """
    from nxdplug.plugin_api import NeuronConfig, from_pretrained

    if neuron_config is None:
        neuron_config = NeuronConfig(
            batch_size=2, seq_len=max_new_tokens + 32, max_context_length=32, torch_dtype="float32"
        )
    model = from_pretrained(model_path, neuron_config)
    model.to_cpu()
    hf_model = model.load_hf_model(model_path, dtype=neuron_config.torch_dtype).eval()
    if prompts is None:
        prompts, attention_mask = random_prompts(model.config.vocab_size, (7, 13))
    return compare_with_hf(
        model,
        hf_model,
        prompts,
        attention_mask,
        max_new_tokens=max_new_tokens,
        mode=mode,
        tolerance=tolerance,
    )


def random_prompts(
    vocab_size: int, lengths: tuple[int, ...], seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts of the given lengths (ids 1.., so not the usual pad id 0)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(
            1, vocab_size, (length,), generator=generator
        )
        mask[row, width - length :] = 1
    return input_ids, mask
