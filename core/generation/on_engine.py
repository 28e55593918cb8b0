"""``generate()`` over more rows than the KV cache holds, through the serving engine.

A continuous-batching model (``is_continuous_batching=True``) holds ``max_batch_size``
sequences. Given more rows, ``generate()`` hands each row to the engine as a request, as vLLM's
offline ``generate`` does: the first rows take the cache lines, each of the others takes the line
of a row that ended, and the step loop is the one ``nxdplug serve`` runs. What a request's
:class:`~nxdplug.engine.SamplingSettings` carry is honoured (greedy, or temperature / top_k /
top_p; on the host each sampled row has its own generator seeded from torch's global one, a
model that samples in its graph draws from torch's global stream; the token budget;
the end-of-sequence tokens; HF's ``repetition_penalty``, ``min_new_tokens`` and one-token
``sequence_bias``, which the engine applies per request, each row's penalty over its own prompt
and output); step-input keywords given as one value per row (an adapter id each) go with each
row's request. HF's other processors and criteria, streamers and the per-step scores need the
rows in one batch, and are refused. The result has HF's shape: each row's prompt as given, then
its tokens, then the pad token once it ended.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from nxdplug.engine import Engine, SamplingSettings
from nxdplug.errors import NotSupportedError
from nxdplug.generation.processors import GenerationParts

if TYPE_CHECKING:
    from transformers import GenerationConfig

    from nxdplug.runtime.application import NeuronBaseForCausalLM

SEED_RANGE = 2**62


def refuse_what_the_engine_ignores(
    parts: GenerationParts, rows: int, step_keywords: dict[str, Any], streamer: Any
) -> None:
    """Raise, naming them, for the settings a row alone in the engine would not honour."""
    given = [type(p).__name__ for p in parts.host_processors if _engine_setting(p) is None]
    given += [type(c).__name__ for c in parts.extra_criteria]
    given += sorted(set(step_keywords) - set(_per_row(step_keywords, rows)))
    if streamer is not None:
        given.append("streamer")
    if parts.config.return_dict_in_generate:
        given.append("return_dict_in_generate")
    if given:
        raise NotSupportedError(
            f"{rows} rows are more than the KV cache holds (max_batch_size), so generate() runs "
            "them through the serving engine, which takes each row's temperature, top_k, top_p, "
            "token budget, end-of-sequence tokens, repetition_penalty, min_new_tokens and "
            f"one-token sequence_bias only; {', '.join(given)} need every row in one batch: "
            "give at most max_batch_size rows, or leave them out"
        )


def generate_on_engine(
    application: NeuronBaseForCausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    parts: GenerationParts,
    new_tokens: int,
    step_keywords: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Each row of ``input_ids`` (its prompt: the tokens ``attention_mask`` keeps) decoded as
    its own engine request; [rows, prompt width + longest output], padded after a row ends.
    ``step_keywords`` given as one value per row (None: the row has none) go with each row's
    request."""
    config = parts.config
    eos = config._eos_token_tensor
    eos_ids = [] if eos is None else eos.view(-1).tolist()
    engine = Engine(application, eos_token_ids=eos_ids, max_waiting=len(input_ids))
    seeded = engine.choice.samples_on_host  # a graph that samples draws from torch's own stream
    mapped = [_engine_setting(p, input_ids.shape[1]) or {} for p in parts.host_processors]
    adjustments = {k: v for setting in mapped for k, v in setting.items() if k != "min_tokens"}
    held = max((setting.get("min_tokens", 0) for setting in mapped), default=0)
    adjustments["min_tokens"] = min(held, new_tokens)
    settings = attrs.evolve(_settings(config, new_tokens, seeded), **adjustments)
    per_row = _per_row(step_keywords or {}, len(input_ids))
    try:
        request_ids = [
            engine.add_request(
                prompt,
                settings,
                step_keywords={k: v[row] for k, v in per_row.items() if v[row] is not None},
            )
            for row, prompt in enumerate(_prompts(input_ids, attention_mask))
        ]
        made: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
        while engine.has_unfinished():
            for output in engine.step():
                made[output.request_id].extend(output.token_ids)
    finally:
        engine.close()
    longest = max(len(tokens) for tokens in made.values())
    pad = int(config._pad_token_tensor) if config._pad_token_tensor is not None else 0
    new = [tokens + [pad] * (longest - len(tokens)) for tokens in made.values()]
    new_ids = torch.tensor(new, dtype=input_ids.dtype, device=input_ids.device)
    return torch.cat([input_ids, new_ids], dim=1)


def _prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    return [
        [token for token, kept in zip(row, mask, strict=True) if kept]
        for row, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True)
    ]


def _per_row(step_keywords: dict[str, Any], rows: int) -> dict[str, list[Any]]:
    """The step keywords given as a list of one value per row, which the engine's requests
    carry one each (a tensor stays the batch's)."""
    return {
        keyword: list(values)
        for keyword, values in step_keywords.items()
        if isinstance(values, list | tuple) and len(values) == rows
    }


def _engine_setting(processor: Any, prompt_width: int = 0) -> dict[str, Any] | None:
    """The engine's settings for one of HF's processors, or None where it has none.
    ``prompt_width``: the padded prompts' width, from which HF counts ``min_length``."""
    if isinstance(processor, RepetitionPenaltyLogitsProcessor):
        # HF skips each row's padding (a tensor of its lengths); the engine sees no padding
        if not isinstance(processor.prompt_ignore_length, int):
            return {"repetition_penalty": processor.penalty}
    elif isinstance(processor, MinNewTokensLengthLogitsProcessor):
        return {"min_tokens": processor.min_new_tokens}
    elif isinstance(processor, MinLengthLogitsProcessor):
        return {"min_tokens": max(processor.min_length - prompt_width, 0)}
    elif isinstance(processor, SequenceBiasLogitsProcessor):
        biases = processor.sequence_bias
        if all(len(tokens) == 1 for tokens in biases):
            return {"logit_bias": [(tokens[0], bias) for tokens, bias in biases.items()]}
    return None


def _settings(config: GenerationConfig, new_tokens: int, seeded: bool) -> SamplingSettings:
    if not config.do_sample:
        return SamplingSettings(max_tokens=new_tokens, temperature=0)
    return SamplingSettings(
        max_tokens=new_tokens,
        temperature=config.temperature,
        top_k=config.top_k or 0,
        top_p=config.top_p,
        seed=int(torch.randint(SEED_RANGE, ())) if seeded else None,
    )
