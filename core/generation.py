"""HuggingFaceGenerationAdapter: HF-style ``generate()`` over an nxdplug causal LM.

Greedy and multinomial sampling, with HF's defaults and semantics: ``max_new_tokens`` wins over
``max_length``, finished rows are filled with ``pad_token_id``, generation stops when every row
has produced an end-of-sequence token. The samplers come from the ``samplers`` plugins.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from nxdplug.errors import NotSupportedError, NxdPlugError
from nxdplug.registry import get_registry
from nxdplug.sampling import SamplingParams

# transformers' own fallbacks for settings neither the model nor the caller gives.
HF_DEFAULTS = {"max_length": 20, "top_k": 50, "top_p": 1.0, "temperature": 1.0, "do_sample": False}

# Settings that change what is generated and that this adapter does not implement.
UNSUPPORTED_SETTINGS = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "min_length": 0,
    "min_new_tokens": None,
    "min_p": None,
    "typical_p": 1.0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "prompt_lookup_num_tokens": None,
}


def _token_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


class HuggingFaceGenerationAdapter:
    """Wraps a NeuronBaseForCausalLM so that ``generate()`` works as with HF transformers."""

    def __init__(self, model: Any, input_capture_hook: Any = None) -> None:
        self.neuron_model = model
        self.config = model.config
        self.input_capture_hook = input_capture_hook
        self.generation_config = self._model_generation_config(model)

    @staticmethod
    def _model_generation_config(model: Any) -> GenerationConfig:
        folder = Path(model.model_path)
        if (folder / "generation_config.json").is_file():
            return GenerationConfig.from_pretrained(str(folder))
        tokens = {
            name: getattr(model.config, name, None)
            for name in ("bos_token_id", "eos_token_id", "pad_token_id")
        }
        return GenerationConfig(**{k: v for k, v in tokens.items() if v is not None})

    def resolve_generation_config(
        self, generation_config: GenerationConfig | None, **kwargs: Any
    ) -> GenerationConfig:
        """The caller's config (or the model's), updated with ``kwargs``, HF defaults filled."""
        config = copy.deepcopy(generation_config or self.generation_config)
        unused = config.update(**kwargs)
        if unused:
            raise NxdPlugError(
                f"generate() got unknown argument(s) {sorted(unused)}; they are neither "
                "GenerationConfig fields nor inputs this adapter takes"
            )
        for name, default in HF_DEFAULTS.items():
            if getattr(config, name, None) is None:
                setattr(config, name, default)
        unsupported = [
            f"{name}={getattr(config, name)!r}"
            for name, neutral in UNSUPPORTED_SETTINGS.items()
            if getattr(config, name, neutral) not in (neutral, None)
        ]
        if unsupported:
            raise NotSupportedError(
                f"generate() supports greedy and multinomial sampling only; "
                f"not implemented: {', '.join(unsupported)}"
            )
        if config.pad_token_id is None and config.eos_token_id is not None:
            config.pad_token_id = _token_ids(config.eos_token_id)[0]
        return config

    def _new_token_budget(self, config: GenerationConfig, prompt_length: int) -> int:
        total = (
            prompt_length + config.max_new_tokens
            if config.max_new_tokens is not None
            else config.max_length
        )
        seq_len = self.neuron_model.neuron_config.seq_len
        if total > seq_len:
            raise NxdPlugError(
                f"generation needs {total} positions (prompt {prompt_length} + new tokens) but "
                f"the model was configured with seq_len={seq_len}; lower max_new_tokens / "
                "max_length or raise seq_len"
            )
        if total <= prompt_length:
            raise NxdPlugError(
                f"max_length={total} leaves no room after a prompt of {prompt_length} tokens; "
                "set max_new_tokens"
            )
        return total - prompt_length

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | GenerateDecoderOnlyOutput:
        """Generate continuations of ``input_ids`` ([batch, prompt]); returns prompt + new tokens
        (or a GenerateDecoderOnlyOutput when ``return_dict_in_generate``)."""
        config = self.resolve_generation_config(generation_config, **kwargs)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        new_tokens = self._new_token_budget(config, input_ids.shape[1])
        sampler_name = "multinomial" if config.do_sample else "greedy"
        sampler = get_registry().get("samplers", sampler_name).load("implementation")()
        params = self._sampling_params(config)
        eos = torch.tensor(_token_ids(config.eos_token_id), dtype=input_ids.dtype)
        pad = config.pad_token_id if config.pad_token_id is not None else 0

        model = self.neuron_model
        model.reset()
        sequences, mask = input_ids, attention_mask
        unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool)
        all_logits: list[torch.Tensor] = []
        all_scores: list[torch.Tensor] = []
        step_input = input_ids
        for step in range(new_tokens):
            outputs = model(
                input_ids=step_input,
                attention_mask=mask,
                input_capture_hook=self.input_capture_hook,
            )
            logits = outputs.logits[:, -1, :]
            all_logits.append(logits)
            if config.output_scores:
                all_scores.append(sampler.scores(logits, params))
            next_tokens = sampler(logits, params)
            next_tokens = torch.where(unfinished, next_tokens, torch.full_like(next_tokens, pad))
            sequences = torch.cat([sequences, next_tokens[:, None]], dim=-1)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
            unfinished &= ~torch.isin(next_tokens, eos)
            if not unfinished.any() or step == new_tokens - 1:
                break
            step_input = next_tokens[:, None]

        if not config.return_dict_in_generate:
            return sequences
        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=tuple(all_scores) if config.output_scores else None,
            logits=tuple(all_logits) if config.output_logits else None,
        )

    @staticmethod
    def _sampling_params(config: GenerationConfig) -> SamplingParams:
        return SamplingParams(
            top_k=config.top_k or 0, top_p=config.top_p, temperature=config.temperature
        )
