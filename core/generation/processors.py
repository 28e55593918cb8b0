"""transformers' own logits processors and stopping criteria for ``generate()``.

GenerationMixin builds them from a GenerationConfig (``_prepare_special_tokens``,
``_prepare_generated_length``, ``_get_logits_processor``, ``_get_stopping_criteria``). Those
methods are called here on a stand-in that holds only what they read of a model (a decoder-only
config with its vocabulary and position sizes), so every processor and criterion, their
arguments and their order are transformers' own, never copies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerationMixin

if TYPE_CHECKING:
    from nxdplug.config import InferenceConfig

# transformers' max_length when neither the model nor the caller sets one (prompt + 20 tokens).
HF_DEFAULT_MAX_LENGTH = 20

# What a sampler does itself, on the host or in the model's graph: HF's warpers of the
# GenerationConfig's temperature, top_k and top_p.
SAMPLER_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
# The criteria generate() always has (its length, the end-of-sequence tokens).
LOOP_CRITERIA = (MaxLengthCriteria, EosTokenCriteria)


class _DecoderOnlyConfig:
    """What GenerationMixin's builders read of a model's config."""

    is_encoder_decoder = False

    def __init__(self, model_config: InferenceConfig) -> None:
        self.vocab_size = getattr(model_config, "vocab_size", None)
        self.max_position_embeddings = getattr(model_config, "max_position_embeddings", None)

    def get_text_config(self, decoder: bool | None = None) -> _DecoderOnlyConfig:
        return self


class _TransformersBuilders(GenerationMixin):
    """GenerationMixin's builders, bound to a config instead of a transformers model."""

    def __init__(self, model_config: InferenceConfig) -> None:
        self.config = _DecoderOnlyConfig(model_config)


@dataclass(frozen=True)
class GenerationParts:
    """transformers' pieces of one ``generate()`` call.

    ``config`` has its final ``max_length`` / ``min_length`` and the special tokens as tensors
    (``_eos_token_tensor``, ``_pad_token_tensor``); ``processors`` turn a step's float32 logits
    into HF's scores (warpers included when sampling); ``criteria`` say which rows are done.
    """

    config: GenerationConfig
    processors: LogitsProcessorList
    criteria: StoppingCriteriaList

    @property
    def host_processors(self) -> list[Any]:
        """Processors a sampler does not do itself: they need the logits on the host."""
        return [p for p in self.processors if not isinstance(p, SAMPLER_WARPERS)]

    @property
    def extra_criteria(self) -> list[Any]:
        """Criteria besides the length and end-of-sequence ones (stop strings, the caller's)."""
        return [c for c in self.criteria if not isinstance(c, LOOP_CRITERIA)]

    @property
    def pads_finished_rows(self) -> bool:
        """HF fills finished rows with the pad token only when an end-of-sequence criterion is
        present."""
        return any(hasattr(c, "eos_token_id") for c in self.criteria)


def generation_parts(
    config: GenerationConfig,
    model_config: InferenceConfig,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    tokenizer: Any = None,
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None,
) -> GenerationParts:
    """Build transformers' processors and criteria for ``input_ids`` (already expanded by
    ``num_return_sequences``), as ``GenerationMixin.generate`` does; ``config`` is updated in
    place (a copy the caller owns)."""
    builders = _TransformersBuilders(model_config)
    has_default_max_length = config.max_length is None
    has_default_min_length = config.min_length is None
    if has_default_max_length:
        config.max_length = HF_DEFAULT_MAX_LENGTH
    if has_default_min_length:
        config.min_length = 0
    builders._prepare_special_tokens(
        config, True, device=input_ids.device, batch_size=input_ids.shape[0]
    )
    builders._prepare_generated_length(
        generation_config=config,
        has_default_max_length=has_default_max_length,
        has_default_min_length=has_default_min_length,
        model_input_name="input_ids",
        input_ids_length=input_ids.shape[1],
        inputs_tensor=input_ids,
    )
    # HF drops a mask of ones before building the processors (no padding to ignore).
    mask = None if bool((attention_mask == 1).all()) else attention_mask
    processors = builders._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=input_ids.shape[1],
        encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        logits_processor=logits_processor if logits_processor is not None else [],
        device=input_ids.device,
        model_kwargs={"attention_mask": mask},
    )
    criteria = builders._get_stopping_criteria(
        generation_config=config,
        stopping_criteria=stopping_criteria if stopping_criteria is not None else [],
        tokenizer=tokenizer,
    )
    return GenerationParts(config=config, processors=processors, criteria=criteria)


def expand_for_return_sequences(
    config: GenerationConfig, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row repeated ``num_return_sequences`` times in place (HF's
    ``_expand_inputs_for_generation`` for a decoder-only model's ids and mask)."""
    expand = config.num_return_sequences or 1
    if expand == 1:
        return input_ids, attention_mask
    return (
        input_ids.repeat_interleave(expand, dim=0),
        attention_mask.repeat_interleave(expand, dim=0),
    )
