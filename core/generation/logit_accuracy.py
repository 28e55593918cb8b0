"""NxD Inference's logit accuracy check of an application against HF transformers on the CPU.

``generate_expected_logits`` takes the reference logits from the transformers model of the same
checkpoint (the application's ``load_hf_model``); ``check_accuracy_logits`` (and its keyword
form ``check_accuracy_logits_v2``) greedily generates with the application through
:class:`HuggingFaceGenerationAdapter` and compares the two with
:func:`~nxdplug.generation.logit_validation.logit_validation`, teacher forcing included, raising
:class:`~nxdplug.generation.logit_validation.LogitMatchingValidationError` on a mismatch.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig

from nxdplug.errors import ConfigError, NotSupportedError, NxdPlugError
from nxdplug.generation.accuracy import TEST_PROMPT, reference_model
from nxdplug.generation.hf_adapter import HuggingFaceGenerationAdapter
from nxdplug.generation.logit_validation import LogitMatchingValidationError, logit_validation

if TYPE_CHECKING:
    from nxdplug.runtime.application import NeuronBaseForCausalLM

TolMap = Mapping[str | int, tuple[float, float]]


def generate_expected_logits(
    neuron_model: NeuronBaseForCausalLM,
    input_ids: torch.Tensor,
    inputs_attention_mask: torch.Tensor,
    generation_config: GenerationConfig | None,
    num_tokens: int | None = None,
    additional_input_args: Mapping[str, Any] | None = None,
    tokenizer: Any = None,
) -> torch.Tensor:
    """The HF model's greedy scores for ``input_ids``, [num_tokens, batch, vocab].

    ``num_tokens`` defaults to (and is capped at) what ``seq_len`` leaves after the prompt.
    ``additional_input_args`` override or extend the ``generate()`` keywords. ``tokenizer`` is
    accepted for NxD Inference's signature (it only logs there).
    """
    num_tokens = _tokens_to_check(neuron_model, input_ids.shape[1], num_tokens)
    hf_model = reference_model(neuron_model)
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": inputs_attention_mask,
        "max_new_tokens": num_tokens,
        "min_new_tokens": num_tokens,
        "do_sample": False,
        "return_dict_in_generate": True,
        "output_scores": True,
        "generation_config": generation_config,
    } | dict(additional_input_args or {})
    with torch.inference_mode():
        outputs = hf_model.generate(**kwargs)
    return torch.stack(outputs.scores)[:num_tokens]


def check_accuracy_logits(
    neuron_model: NeuronBaseForCausalLM,
    tokenizer: Any = None,
    generation_config: GenerationConfig | None = None,
    prompt: str | None = None,
    expected_logits: torch.Tensor | None = None,
    divergence_difference_tol: float = 0.001,
    tol_map: TolMap | None = None,
    num_tokens_to_check: int | None = None,
    execution_mode: str = "config",
    draft_model: NeuronBaseForCausalLM | None = None,
    image: Any = None,
    num_image_per_prompt: int = 1,
    inputs: Any = None,
    input_start_offsets: Any = None,
    pad_token_id: int = 0,
    image_processor: Any = None,
    tensor_capture_hook: Any = None,
    generate_fn_divergence: bool = False,
) -> list[list[dict[str, Any]]]:
    """Compare the application's logits with HF's (or ``expected_logits``) and return the
    per-position results; raise LogitMatchingValidationError when they do not match.

    The prompts are ``prompt`` (NxD Inference's test prompt by default) once per batch row,
    tokenized by ``tokenizer``, unless ``inputs`` (with ``input_ids`` and ``attention_mask``)
    are given. Deprecated in NxD Inference in favour of :func:`check_accuracy_logits_v2`, and
    warns as it does. Images, speculation, input offsets, tensor capture and
    ``generate_fn_divergence`` are refused; ``execution_mode`` and ``pad_token_id`` change
    nothing here.
    """
    warnings.warn(
        "'check_accuracy_logits' is deprecated and replaced by 'check_accuracy_logits_v2'",
        DeprecationWarning,
        stacklevel=2,
    )
    _refuse(
        image=image,
        image_processor=image_processor,
        draft_model=draft_model,
        input_start_offsets=input_start_offsets,
        tensor_capture_hook=tensor_capture_hook,
        generate_fn_divergence=generate_fn_divergence,
    )
    if inputs is None:
        if tokenizer is None:
            raise NxdPlugError(
                "check_accuracy_logits needs a tokenizer, or inputs with input_ids and "
                "attention_mask"
            )
        batch_size = neuron_model.config.neuron_config.batch_size
        inputs = tokenizer([prompt or TEST_PROMPT] * batch_size, padding=True, return_tensors="pt")
    num_tokens = _tokens_to_check(neuron_model, inputs.input_ids.shape[1], num_tokens_to_check)
    if expected_logits is None:
        expected_logits = generate_expected_logits(
            neuron_model, inputs.input_ids, inputs.attention_mask, generation_config, num_tokens
        )
    return check_accuracy_logits_v2(
        neuron_model,
        expected_logits,
        inputs.input_ids,
        inputs.attention_mask,
        generation_config,
        divergence_difference_tol=divergence_difference_tol,
        tol_map=tol_map,
        num_tokens_to_check=num_tokens,
    )


def check_accuracy_logits_v2(
    neuron_model: NeuronBaseForCausalLM,
    expected_logits: torch.Tensor,
    inputs_input_ids: torch.Tensor,
    inputs_attention_mask: torch.Tensor,
    generation_config: GenerationConfig | None,
    divergence_difference_tol: float = 0.001,
    tol_map: TolMap | None = None,
    num_tokens_to_check: int | None = None,
    input_start_offsets: Any = None,
    additional_input_args: Mapping[str, Any] | None = None,
    tokenizer: Any = None,
) -> list[list[dict[str, Any]]]:
    """Compare the application's logits on the given prompts with ``expected_logits``
    [steps, batch, vocab]; return the per-position results, or raise
    LogitMatchingValidationError. ``additional_input_args`` override or extend the keywords of
    every ``generate()``."""
    _refuse(input_start_offsets=input_start_offsets)
    neuron_config = neuron_model.config.neuron_config
    if neuron_config.on_device_sampling_config is not None and not neuron_config.output_logits:
        raise ConfigError(
            ["logit validation with on_device_sampling_config needs output_logits=True"]
        )
    if neuron_config.enable_fused_speculation or neuron_config.speculation_length:
        raise NotSupportedError(
            "logit validation of speculative decoding is not supported: generate() returns no "
            "scores with speculation"
        )
    prompt_length = inputs_input_ids.shape[1]
    num_tokens = _tokens_to_check(neuron_model, prompt_length, num_tokens_to_check)
    num_tokens = min(num_tokens, expected_logits.shape[0])
    if prompt_length + num_tokens > neuron_config.max_context_length:
        warnings.warn(
            "input length + num_tokens_to_check exceeds max_context_length: a divergence past "
            "max_context_length makes the teacher-forced prompt too long for context encoding; "
            "set num_tokens_to_check to max_context_length - input length or less",
            UserWarning,
            stacklevel=2,
        )
    expected_logits = expected_logits[:num_tokens]
    adapter = HuggingFaceGenerationAdapter(neuron_model)
    mask = torch.cat(
        [
            inputs_attention_mask,
            inputs_attention_mask.new_ones(len(inputs_attention_mask), num_tokens),
        ],
        dim=1,
    )
    takes_tokens = neuron_config.on_device_sampling_config is not None

    def generate_fn(input_ids: torch.Tensor) -> Any:
        length = input_ids.shape[1]
        new_tokens = prompt_length + num_tokens - length
        kwargs = {
            "attention_mask": mask[:, :length],
            "max_new_tokens": new_tokens,
            "min_new_tokens": new_tokens,
            "do_sample": False,
            "return_dict_in_generate": True,
            "output_scores": True,
            "generation_config": generation_config,
        } | dict(additional_input_args or {})
        outputs = adapter.generate(input_ids, **kwargs)
        logits = torch.stack(outputs.scores)
        return (logits, outputs.sequences[:, length:]) if takes_tokens else logits

    passed, results, message = logit_validation(
        inputs_input_ids,
        generate_fn,
        expected_logits,
        tol_map=tol_map,
        divergence_difference_tol=divergence_difference_tol,
    )
    if not passed:
        raise LogitMatchingValidationError(message, results)
    return results


def _tokens_to_check(
    neuron_model: NeuronBaseForCausalLM, prompt_length: int, requested: int | None
) -> int:
    """What ``seq_len`` leaves after the prompt, or fewer when ``requested``."""
    room = neuron_model.config.neuron_config.seq_len - prompt_length
    if room < 1:
        raise NxdPlugError(
            f"a prompt of {prompt_length} tokens leaves no room in seq_len="
            f"{neuron_model.config.neuron_config.seq_len}"
        )
    if requested is None:
        return room
    if requested < 1:
        raise NxdPlugError(f"num_tokens_to_check must be 1 or more; got {requested}")
    return min(room, requested)


def _refuse(**given: Any) -> None:
    named = [name for name, value in given.items() if value is not None and value is not False]
    if named:
        raise NotSupportedError(f"logit validation does not take {', '.join(named)} yet")
