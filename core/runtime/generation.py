"""HuggingFaceGenerationAdapter: HF-style ``generate()`` over an nxdplug causal LM.

Greedy and multinomial sampling, with HF's defaults and semantics: ``max_new_tokens`` wins over
``max_length``, finished rows are filled with ``pad_token_id``, generation stops when every row
has produced an end-of-sequence token. The samplers come from the ``samplers`` plugins, unless an
enabled plugin answers ``nxdplug_token_source`` (a model that samples in its graph gives its own
tokens). Keywords that step-input plugins declare (``sampling_params``, ...) are handed to the
model at every step.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from nxdplug.errors import NotSupportedError, NxdPlugError
from nxdplug.registry import get_registry
from nxdplug.runtime.application import refuse_untaken_keywords
from nxdplug.runtime.sampling import SamplingParams
from nxdplug.runtime.speculation import SpeculativeRequest, TokenChoice

# transformers' own fallbacks for settings neither the model nor the caller gives.
HF_DEFAULTS = {"top_k": 50, "top_p": 1.0, "temperature": 1.0, "do_sample": False}
# transformers 5 generates this many new tokens when neither max_new_tokens nor max_length is set.
HF_DEFAULT_NEW_TOKENS = 20

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
}


def _token_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


class TokenSource(Protocol):
    """Where ``generate()`` takes each step's tokens from.

    ``step_keywords`` are given to the model's forward at every step (per-row inputs of
    step-input plugins).
    """

    step_keywords: dict[str, Any]

    def next_tokens(self, outputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(tokens [batch], logits [batch, vocab] or None)`` of one step's outputs."""

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """HF's processed scores of each row (``output_scores``)."""


class HostSampling:
    """Tokens chosen on the host by a sampler plugin from the model's logits."""

    def __init__(self, config: GenerationConfig, step_keywords: dict[str, Any]) -> None:
        name = "multinomial" if config.do_sample else "greedy"
        self.sampler = get_registry().get("samplers", name).load("implementation")()
        self.params = SamplingParams(
            top_k=config.top_k or 0, top_p=config.top_p, temperature=config.temperature
        )
        self.step_keywords = step_keywords

    def next_tokens(self, outputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = outputs.logits[:, -1, :]
        return self.sampler(logits, self.params), logits

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        return self.sampler.scores(logits, self.params)


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
            if config.max_length is not None
            else prompt_length + HF_DEFAULT_NEW_TOKENS
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
        sampling_params: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | GenerateDecoderOnlyOutput:
        """Generate continuations of ``input_ids`` ([batch, prompt]); returns prompt + new tokens
        (or a GenerateDecoderOnlyOutput when ``return_dict_in_generate``).

        ``sampling_params`` and the keywords of other step-input plugins go to the model; with
        on-device sampling (its plugin's token source) the model samples, by default with the
        GenerationConfig's settings as one row per request when ``dynamic=True``.
        """
        assistant_model = kwargs.pop("assistant_model", None)
        step_keywords = self._step_keywords(sampling_params, kwargs)
        config = self.resolve_generation_config(generation_config, **kwargs)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        new_tokens = self._new_token_budget(config, input_ids.shape[1])
        speculation_mode = self.neuron_model.plugins.speculation_mode
        if speculation_mode is not None or assistant_model is not None:
            if step_keywords:
                raise NotSupportedError(
                    f"{', '.join(sorted(step_keywords))} cannot be given with speculative "
                    "decoding: the speculation mode makes its own steps"
                )
            return self._speculate(
                speculation_mode, config, input_ids, attention_mask, new_tokens, assistant_model
            )
        if config.prompt_lookup_num_tokens:
            raise NotSupportedError(
                "prompt_lookup_num_tokens verifies the looked-up tokens in one target call: "
                "the model needs NeuronConfig(speculation_length=k, trace_tokengen_model=False)"
                " with k >= prompt_lookup_num_tokens"
            )
        sampling = self._token_source(config, input_ids.shape[0], step_keywords, kwargs)
        keep_scores = config.return_dict_in_generate and config.output_scores
        eos = torch.tensor(_token_ids(config.eos_token_id), dtype=input_ids.dtype)
        pad = config.pad_token_id if config.pad_token_id is not None else 0

        model = self.neuron_model
        model.reset()
        sequences, mask = input_ids, attention_mask
        unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool)
        all_logits: list[torch.Tensor | None] = []
        all_scores: list[torch.Tensor] = []
        step_input = input_ids
        for step in range(new_tokens):
            outputs = model(
                input_ids=step_input,
                attention_mask=mask,
                input_capture_hook=self.input_capture_hook,
                **sampling.step_keywords,
            )
            next_tokens, logits = sampling.next_tokens(outputs)
            all_logits.append(logits)
            if keep_scores:
                all_scores.append(sampling.scores(logits))
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

    def _speculate(
        self,
        speculation_mode: Any,
        config: GenerationConfig,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        new_tokens: int,
        assistant_model: Any,
    ) -> torch.Tensor:
        """Hand the generation to the speculation mode's speculator."""
        if speculation_mode is None:
            raise NotSupportedError(
                "assistant_model needs a target that verifies several tokens per call: build "
                "it with NeuronConfig(speculation_length=k, trace_tokengen_model=False)"
            )
        if config.return_dict_in_generate:
            raise NotSupportedError(
                "return_dict_in_generate is not supported with speculative decoding; the "
                "tokens are returned, and the acceptance is in model.speculation_stats"
            )
        host = HostSampling(config, {})
        request = SpeculativeRequest(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            choice=TokenChoice(host.sampler, host.params, bool(config.do_sample)),
            eos_token_ids=torch.tensor(_token_ids(config.eos_token_id), dtype=torch.long),
            pad_token_id=config.pad_token_id if config.pad_token_id is not None else 0,
            assistant_model=assistant_model,
            prompt_lookup_num_tokens=config.prompt_lookup_num_tokens,
        )
        speculator = speculation_mode.load("implementation")(self.neuron_model)
        return speculator.generate(request)

    def _step_keywords(
        self, sampling_params: torch.Tensor | None, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """The step-input keywords among ``generate()``'s (taken out of ``kwargs``); one no
        enabled plugin takes is refused, naming the plugin that would."""
        declared = {k for r in get_registry().records("step_inputs") for k in r.keywords}
        given = {"sampling_params": sampling_params} | {
            name: kwargs.pop(name) for name in declared & set(kwargs)
        }
        given = {name: value for name, value in given.items() if value is not None}
        refuse_untaken_keywords(self.neuron_model.context, given)
        return given

    def _token_source(
        self,
        config: GenerationConfig,
        batch: int,
        step_keywords: dict[str, Any],
        kwargs: dict[str, Any],
    ) -> TokenSource:
        """Where the tokens come from: an enabled plugin's source, else a host sampler."""
        context = self.neuron_model.context
        source = context.hook("nxdplug_token_source")(
            context=context,
            generation_config=config,
            batch_size=batch,
            step_keywords=step_keywords,
            generate_kwargs=kwargs,
        )
        return source if source is not None else HostSampling(config, step_keywords)
