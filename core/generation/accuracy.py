"""NxD Inference's token accuracy helpers: ``get_generate_outputs`` (tokenize prompts, generate,
decode) and ``check_accuracy`` (the same tokens as HF transformers on the CPU).

Scripts from the NxD Inference feature guide (draft-model and fused speculation) call
``get_generate_outputs``; with ``draft_model`` the draft application is passed to ``generate()``
as ``assistant_model``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nxdplug.errors import NotSupportedError
from nxdplug.generation.hf_adapter import HuggingFaceGenerationAdapter

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel

    from nxdplug.runtime.application import NeuronBaseForCausalLM

# NxD Inference's default prompt for its accuracy checks.
TEST_PROMPT = "Hello, I am a language model, and I am here to help,"


def reference_model(neuron_model: NeuronBaseForCausalLM) -> torch.nn.Module:
    """HF transformers' model of the application's checkpoint in float32, NxD Inference's
    reference: ``load_hf_model(model_path)`` called as NxD Inference calls it (so a model
    class's own override works), then cast (transformers 4 loaded float32 by default;
    transformers 5 keeps a bf16 checkpoint in bf16, and the cast up is exact)."""
    return neuron_model.load_hf_model(neuron_model.model_path).to(torch.float32).eval()


def get_generate_outputs(
    model: PreTrainedModel | NeuronBaseForCausalLM,
    prompts: list[str],
    tokenizer: Any,
    is_hf: bool = False,
    draft_model: PreTrainedModel | NeuronBaseForCausalLM | None = None,
    generation_config: GenerationConfig | None = None,
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


def check_accuracy(
    neuron_model: NeuronBaseForCausalLM,
    tokenizer: Any,
    generation_config: GenerationConfig | None = None,
    expected_token_ids: Any = None,
    num_tokens_to_check: int | None = None,
    do_sample: bool = False,
    draft_model: NeuronBaseForCausalLM | None = None,
    prompt: str | None = None,
    image: Any = None,
    input_start_offsets: Any = None,
    execution_mode: str = "config",
) -> None:
    """Assert that the application generates the tokens HF transformers does on the CPU (or
    ``expected_token_ids``), up to the neuron config's ``max_length``.

    ``prompt`` (NxD Inference's test prompt by default) is repeated once per batch row; pad
    tokens are dropped before comparing, and only the first ``num_tokens_to_check`` tokens of
    each row (prompt included) are compared when it is given. With speculation the shorter
    output decides how many tokens are compared. Raises AssertionError on a mismatch.
    """
    if image is not None or input_start_offsets is not None:
        raise NotSupportedError("check_accuracy does not take image or input_start_offsets yet")
    neuron_config = neuron_model.neuron_config
    kwargs = {"do_sample": do_sample, "max_length": neuron_config.max_length}
    prompts = [prompt or TEST_PROMPT] * neuron_config.batch_size
    if expected_token_ids is None:
        hf_model = reference_model(neuron_model)
        with torch.inference_mode():
            expected_token_ids, _ = get_generate_outputs(
                hf_model,
                prompts,
                tokenizer,
                is_hf=True,
                generation_config=generation_config,
                **kwargs,
            )
    expected_token_ids = getattr(expected_token_ids, "sequences", expected_token_ids)
    actual_token_ids, _ = get_generate_outputs(
        neuron_model,
        prompts,
        tokenizer,
        draft_model=draft_model,
        generation_config=generation_config,
        **kwargs,
    )
    pad = tokenizer.pad_token_id
    expected = _unpadded(torch.as_tensor(expected_token_ids), pad, num_tokens_to_check)
    actual = _unpadded(actual_token_ids, pad, num_tokens_to_check)
    if draft_model is not None or neuron_config.enable_fused_speculation:
        # Speculation may stop a few tokens short of max_length.
        shorter = min(expected.shape[-1], actual.shape[-1])
        assert abs(expected.shape[-1] - actual.shape[-1]) <= neuron_config.speculation_length, (
            "the speculative model generated an unexpected number of tokens: "
            f"{actual.shape[-1]} against HF's {expected.shape[-1]}"
        )
        expected, actual = expected[:, :shorter], actual[:, :shorter]
    assert torch.equal(actual, expected), f"\nActual (nxdplug): {actual}\nExpected (HF): {expected}"


def _unpadded(token_ids: torch.Tensor, pad_token_id: int, limit: int | None) -> torch.Tensor:
    rows = [row[row != pad_token_id][:limit] for row in token_ids]
    if len({len(row) for row in rows}) > 1:
        raise AssertionError(
            "rows have different numbers of tokens once padding is dropped: "
            f"{[len(row) for row in rows]}"
        )
    return torch.stack(rows)


def prepare_inputs_from_prompt(
    neuron_model: NeuronBaseForCausalLM, tokenizer: Any, prompt: str | None = None
) -> Any:
    """NxD Inference's: the tokenizer's padded batch of ``prompt`` (TEST_PROMPT by default),
    one row per sequence the model runs at once (``batch_size``; ``max_num_seqs`` with
    chunked prefill)."""
    if tokenizer is None:
        raise ValueError("A tokenizer is required to prepare inputs")
    neuron_config = neuron_model.config.neuron_config
    chunked_prefill = neuron_config.chunked_prefill_config
    rows = neuron_config.batch_size if chunked_prefill is None else chunked_prefill.max_num_seqs
    return tokenizer(
        [TEST_PROMPT if prompt is None else prompt] * rows, padding=True, return_tensors="pt"
    )


def shift_inputs_by_offset(
    inputs: Any, input_start_offsets: list[int] | None, pad_token_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """NxD Inference's: ``inputs``' input_ids and attention_mask moved right by each row's
    offset (one offset: every row's), padded before with ``pad_token_id`` and 0; unchanged
    without offsets."""
    if not input_start_offsets:
        return inputs.input_ids, inputs.attention_mask
    return shift_right(
        inputs.input_ids, inputs.attention_mask, list(input_start_offsets), pad_token_id
    )


def shift_right(
    ids: torch.Tensor, mask: torch.Tensor, offsets: list[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row moved right by its offset (one offset: every row's), padding before it."""
    rows, width = ids.shape
    offsets = offsets * rows if len(offsets) == 1 else offsets
    shifted_ids = ids.new_full((rows, width + max(offsets)), pad_id)
    shifted_mask = mask.new_zeros((rows, width + max(offsets)))
    for row, offset in enumerate(offsets):
        shifted_ids[row, offset : offset + width] = ids[row]
        shifted_mask[row, offset : offset + width] = mask[row]
    return shifted_ids, shifted_mask
