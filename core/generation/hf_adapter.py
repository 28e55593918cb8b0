"""HuggingFaceGenerationAdapter: HF-style ``generate()`` over an nxdplug causal LM.

Greedy and multinomial sampling with HF's defaults and semantics, and transformers' own logits
processors and stopping criteria built from the GenerationConfig (``repetition_penalty``,
``min_new_tokens``, ``stop_strings``, the caller's ``logits_processor`` / ``stopping_criteria``,
...; see ``generate_processors``), streamers and ``num_return_sequences``. On the host each step
is HF's: float32 logits -> processors (warpers included when sampling) -> a sampler plugin's
draw. An enabled feature giving a ``token_source`` (a model that samples in its graph) gives
its own tokens instead. Keywords that step-input plugins declare (``sampling_params``,
...) are handed to the model at every step. Beam search and the modes that need more model calls
per step are refused.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import GenerationConfig, PrefixConstrainedLogitsProcessor
from transformers.generation.utils import GenerateDecoderOnlyOutput

from nxdplug.checkpoint.generation_config import model_generation_config
from nxdplug.errors import NotSupportedError, NxdPlugError
from nxdplug.generation.on_engine import generate_on_engine, refuse_what_the_engine_ignores
from nxdplug.generation.processors import (
    GenerationParts,
    expand_for_return_sequences,
    generation_parts,
)
from nxdplug.registry import get_registry
from nxdplug.runtime.application import refuse_untaken_keywords
from nxdplug.runtime.sampling import SamplingParams
from nxdplug.runtime.scheduled_step import ScheduledStep
from nxdplug.runtime.speculation import SpeculativeRequest, TokenChoice, VerifiedProcessors
from nxdplug.runtime.step_ahead import HostOverlap

if TYPE_CHECKING:
    from nxdplug.runtime.application import NeuronBaseForCausalLM

# transformers' own fallbacks for settings neither the model nor the caller gives (its
# _get_default_generation_params in transformers 5; the lengths are decided with the prompt).
HF_DEFAULTS = {
    name: value
    for name, value in getattr(
        GenerationConfig,
        "_get_default_generation_params",
        lambda: {"top_k": 50, "top_p": 1.0, "temperature": 1.0, "do_sample": False},
    )().items()
    if name not in ("max_length", "min_length")
}

# Generation modes other than greedy and sampling, by transformers' name: the settings that
# select them, and why not.
UNSUPPORTED_MODES = {
    "beam_search": (("num_beams",), "beam search is not implemented; use num_beams=1"),
    "beam_sample": (("num_beams",), "beam sampling is not implemented; use num_beams=1"),
    "group_beam_search": (("num_beams", "num_beam_groups"), "group beam search is not implemented"),
    "constrained_beam_search": (
        ("constraints", "force_words_ids"),
        "constrained beam search is not implemented; bad_words_ids or a logits_processor can "
        "ban tokens instead",
    ),
    "contrastive_search": (("penalty_alpha", "top_k"), "contrastive search is not implemented"),
    "dola_generation": (("dola_layers",), "DoLa decoding is not implemented"),
}
# Settings that need more than one model call per step or a tokenizer round trip.
UNSUPPORTED_SETTINGS = {
    "guidance_scale": (1.0, "classifier-free guidance needs a second model call per step"),
    "token_healing": (False, "token healing is not implemented"),
}
# A draw from already processed scores: the sampler adds nothing of its own.
NEUTRAL = SamplingParams(top_k=0, top_p=1.0, temperature=1.0)


def _token_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


class TokenSource(Protocol):
    """Where ``generate()`` takes each step's tokens from, when a plugin gives them.

    ``step_keywords`` are given to the model's forward at every step (per-row inputs of
    step-input plugins).
    """

    step_keywords: dict[str, Any]

    def next_tokens(self, outputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(tokens [batch], logits [batch, vocab] or None)`` of one step's outputs."""

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """HF's processed scores of each row (``output_scores``)."""


class HostSampling:
    """Tokens chosen on the host, as HF's ``_sample`` does: transformers' processors turn the
    float32 logits into scores, a sampler plugin draws (greedy or multinomial)."""

    def __init__(self, parts: GenerationParts, step_keywords: dict[str, Any]) -> None:
        name = "multinomial" if parts.config.do_sample else "greedy"
        self.sampler = get_registry().get("samplers", name).load("implementation")()
        self.processors = parts.processors
        self.step_keywords = step_keywords

    def step(
        self, outputs: Any, sequences: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens, float32 logits, scores)`` of one step."""
        logits = outputs.logits[:, -1, :].to(dtype=torch.float32, copy=True)
        scores = self.processors(sequences, logits)
        return self.sampler(scores, NEUTRAL), logits, scores


class PluginTokens:
    """A plugin's token source (the model samples in its graph)."""

    def __init__(self, source: TokenSource, keep_scores: bool) -> None:
        self.source = source
        self.step_keywords = source.step_keywords
        self.keep_scores = keep_scores

    def step(
        self, outputs: Any, sequences: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        tokens, logits = self.source.next_tokens(outputs)
        scores = self.source.scores(logits) if self.keep_scores else None
        return tokens, logits, scores


class GenerationProgress:
    """The rows ``generate()`` has made so far and what it keeps for its result; ``add`` is the
    host's work of one step (async mode runs it while the model makes the next)."""

    def __init__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        parts: GenerationParts,
        streamer: Any,
    ) -> None:
        config = parts.config
        self.sequences = input_ids
        self.mask = attention_mask
        self.unfinished = torch.ones(len(input_ids), dtype=torch.long, device=input_ids.device)
        self.criteria = parts.criteria
        self.pads_finished_rows = parts.pads_finished_rows
        self.pad = config._pad_token_tensor
        self.keep_scores = bool(config.return_dict_in_generate and config.output_scores)
        self.keep_logits = bool(config.return_dict_in_generate and config.output_logits)
        self.logits: list[torch.Tensor | None] = []
        self.scores: list[torch.Tensor | None] = []
        self.streamer = streamer
        if streamer is not None:
            streamer.put(input_ids.cpu())

    def mask_with_one_more(self) -> torch.Tensor:
        """The attention mask with one more position."""
        return torch.cat([self.mask, self.mask.new_ones(len(self.mask), 1)], dim=-1)

    def add(
        self, tokens: torch.Tensor, logits: torch.Tensor | None, scores: torch.Tensor | None
    ) -> bool:
        """Append one step's tokens (the pad token in finished rows); True once every row
        has finished."""
        if self.keep_logits:
            self.logits.append(logits)
        if self.keep_scores:
            self.scores.append(scores)
        if self.pads_finished_rows:
            tokens = tokens * self.unfinished + self.pad * (1 - self.unfinished)
        self.sequences = torch.cat([self.sequences, tokens[:, None]], dim=-1)
        self.mask = self.mask_with_one_more()
        self.unfinished = self.unfinished & ~self.criteria(
            self.sequences, tuple(self.scores) or None
        )
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())
        return bool(self.unfinished.max() == 0)

    def result(self, config: GenerationConfig) -> torch.Tensor | GenerateDecoderOnlyOutput:
        """What ``generate()`` returns; ends the streamer."""
        if self.streamer is not None:
            self.streamer.end()
        if not config.return_dict_in_generate:
            return self.sequences
        return GenerateDecoderOnlyOutput(
            sequences=self.sequences,
            scores=tuple(self.scores) if self.keep_scores else None,
            logits=tuple(self.logits) if self.keep_logits else None,
        )


def _application_of(
    assistant_model: NeuronBaseForCausalLM | HuggingFaceGenerationAdapter,
) -> NeuronBaseForCausalLM:
    """The draft application of ``assistant_model``: NxD Inference's scripts pass the draft
    wrapped in its own HuggingFaceGenerationAdapter, others pass the application itself."""
    if isinstance(assistant_model, HuggingFaceGenerationAdapter):
        return assistant_model.neuron_model
    return assistant_model


class HuggingFaceGenerationAdapter:
    """Wraps a NeuronBaseForCausalLM so that ``generate()`` works as with HF transformers."""

    def __init__(self, model: NeuronBaseForCausalLM, input_capture_hook: Any = None) -> None:
        self.neuron_model = model
        self.config = model.config
        self.input_capture_hook = input_capture_hook
        self.generation_config = model_generation_config(model)

    def resolve_generation_config(
        self, generation_config: GenerationConfig | None, **kwargs: Any
    ) -> GenerationConfig:
        """The caller's config (or the model's), updated with ``kwargs``, HF defaults filled;
        modes other than greedy and sampling refused."""
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
        mode = str(getattr(config.get_generation_mode(), "value", config.get_generation_mode()))
        problems = [
            f"{', '.join(f'{n}={getattr(config, n)!r}' for n in names)}: {why}"
            for name, (names, why) in UNSUPPORTED_MODES.items()
            if mode == name
        ]
        problems += [
            f"{name}={getattr(config, name)!r}: {why}"
            for name, (neutral, why) in UNSUPPORTED_SETTINGS.items()
            if getattr(config, name, None) not in (neutral, None)
        ]
        if problems:
            raise NotSupportedError(f"generate() cannot do this: {'; '.join(problems)}")
        if config.pad_token_id is None and config.eos_token_id is not None:
            config.pad_token_id = _token_ids(config.eos_token_id)[0]
        return config

    def _cut_long_prompts(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts wider than max_context_length cut to their first columns, with a warning,
        when ``allow_input_truncation`` is set (context encoding would cut them the same way;
        cutting here keeps the later steps' positions and cache in step with it)."""
        neuron_config = self.neuron_model.neuron_config
        limit = neuron_config.max_context_length
        if input_ids.shape[1] <= limit or not neuron_config.allow_input_truncation:
            return input_ids, attention_mask
        warnings.warn(
            f"Truncating input ({input_ids.shape[1]} tokens) to max_context_length ({limit} "
            "tokens) because allow_input_truncation is set; generation continues the cut prompt",
            stacklevel=3,
        )
        return input_ids[:, :limit], attention_mask[:, :limit]

    def _new_token_budget(self, config: GenerationConfig, prompt_length: int) -> int:
        """New tokens allowed by the prepared ``max_length``, checked against ``seq_len``."""
        total = config.max_length
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
        *,
        logits_processor: Any = None,
        stopping_criteria: Any = None,
        streamer: Any = None,
        tokenizer: Any = None,
        prefix_allowed_tokens_fn: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor | GenerateDecoderOnlyOutput:
        """Generate continuations of ``input_ids`` ([batch, prompt]); returns prompt + new tokens
        (or a GenerateDecoderOnlyOutput when ``return_dict_in_generate``).

        As transformers' ``generate()``: the GenerationConfig's processors and criteria, the
        caller's ``logits_processor`` / ``stopping_criteria`` merged in, ``stop_strings`` with
        ``tokenizer``, a ``streamer`` given the prompt then each step's tokens,
        ``num_return_sequences`` rows per prompt. ``sampling_params`` and the keywords of other
        step-input plugins go to the model; with on-device sampling (its plugin's token source)
        the model samples, by default with the GenerationConfig's settings as one row per request
        when ``dynamic=True``. A continuous-batching model given more rows than its cache holds
        runs them through the serving engine (:mod:`nxdplug.generation.on_engine`).
        """
        assistant_model = _application_of(kwargs.pop("assistant_model", None))
        step_keywords = self._step_keywords(sampling_params, kwargs)
        config = self.resolve_generation_config(generation_config, **kwargs)
        input_ids = input_ids.to(self.neuron_model.device)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(input_ids.device)
        input_ids, attention_mask = self._cut_long_prompts(input_ids, attention_mask)
        input_ids, attention_mask = expand_for_return_sequences(config, input_ids, attention_mask)
        parts = generation_parts(
            config,
            self.config,
            input_ids,
            attention_mask,
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
            tokenizer=tokenizer,
            prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        )
        new_tokens = self._new_token_budget(config, input_ids.shape[1])
        speculation_mode = self.neuron_model.plugins.speculation_mode
        if speculation_mode is not None or assistant_model is not None:
            self._refuse_with_speculation(parts, step_keywords, streamer, input_ids.shape[0])
            return self._speculate(
                speculation_mode, parts, input_ids, attention_mask, new_tokens, assistant_model
            )
        if config.prompt_lookup_num_tokens:
            raise NotSupportedError(
                "prompt_lookup_num_tokens verifies the looked-up tokens in one target call: "
                "the model needs NeuronConfig(speculation_length=k, trace_tokengen_model=False)"
                " with k >= prompt_lookup_num_tokens"
            )
        if self._rows_need_the_engine(input_ids.shape[0]):
            refuse_what_the_engine_ignores(parts, input_ids.shape[0], step_keywords, streamer)
            return generate_on_engine(
                self.neuron_model, input_ids, attention_mask, parts, new_tokens, step_keywords
            )
        sampling = self._token_source(parts, input_ids.shape[0], step_keywords, kwargs)
        progress = GenerationProgress(input_ids, attention_mask, parts, streamer)
        model = self.neuron_model
        model.reset()

        def capture(step_input: torch.Tensor, step_mask: torch.Tensor) -> None:
            if self.input_capture_hook is not None:
                self.input_capture_hook(model, [step_input, step_mask, None, None])

        def call(step_input: torch.Tensor, step_mask: torch.Tensor) -> Any:
            """Each row's next token, after the ones its mask counts before it."""
            capture(step_input, step_mask)
            cached = step_mask.sum(dim=-1) - step_input.shape[1]
            return model.run(ScheduledStep.next_tokens(step_input, cached, sampling.step_keywords))

        overlap = HostOverlap(self._runs_ahead(sampling))
        try:
            capture(input_ids, attention_mask)
            outputs = model.run(
                ScheduledStep.prompts(input_ids, attention_mask, sampling.step_keywords)
            )
            for step in range(new_tokens):
                next_tokens, logits, scores = sampling.step(outputs, progress.sequences)
                last = step == new_tokens - 1
                if overlap.enabled and not last:
                    done, outputs = overlap.run(
                        functools.partial(progress.add, next_tokens, logits, scores),
                        functools.partial(
                            call, next_tokens[:, None], progress.mask_with_one_more()
                        ),
                    )
                else:
                    done = progress.add(next_tokens, logits, scores)
                    if not (done or last):
                        outputs = call(progress.sequences[:, -1:], progress.mask)
                if done or last:
                    break
        finally:
            overlap.close()
        return progress.result(parts.config)

    def _rows_need_the_engine(self, rows: int) -> bool:
        """More rows than a continuous-batching model's cache holds: they take turns in its
        lines through the serving engine."""
        neuron_config = self.neuron_model.neuron_config
        return bool(neuron_config.is_continuous_batching) and rows > neuron_config.max_batch_size

    def _runs_ahead(self, sampling: HostSampling | PluginTokens) -> bool:
        """Whether each step starts before the host handles the last one (async_mode): only
        when the model chooses the tokens, so the next step's inputs are known at once."""
        return bool(self.neuron_model.neuron_config.async_mode) and isinstance(
            sampling, PluginTokens
        )

    @staticmethod
    def _refuse_with_speculation(
        parts: GenerationParts, step_keywords: dict[str, Any], streamer: Any, rows: int
    ) -> None:
        """Speculation modes run the processors at each verified position but stop and stream
        their own way: refuse what they would ignore."""
        given = sorted(step_keywords)
        if rows > 1:
            # Verified positions are processed with filler sequences in the other rows, which
            # the function would be asked about.
            given += [
                f"{type(p).__name__} with {rows} rows"
                for p in parts.host_processors
                if isinstance(p, PrefixConstrainedLogitsProcessor)
            ]
        given += [type(c).__name__ for c in parts.extra_criteria]
        if streamer is not None:
            given.append("streamer")
        if (parts.config.num_return_sequences or 1) > 1:
            given.append(f"num_return_sequences={parts.config.num_return_sequences}")
        if given:
            raise NotSupportedError(
                f"{', '.join(given)} cannot be used with speculative decoding: the speculation "
                "mode makes its own steps; generate without speculation to use them"
            )

    def _speculate(
        self,
        speculation_mode: Any,
        parts: GenerationParts,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        new_tokens: int,
        assistant_model: Any,
    ) -> torch.Tensor:
        """Hand the generation to the speculation mode's speculator."""
        config = parts.config
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
        name = "multinomial" if config.do_sample else "greedy"
        sampler = get_registry().get("samplers", name).load("implementation")()
        params = SamplingParams(
            top_k=config.top_k or 0, top_p=config.top_p, temperature=config.temperature
        )
        request = SpeculativeRequest(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            choice=TokenChoice(sampler, params, bool(config.do_sample)),
            eos_token_ids=torch.tensor(
                _token_ids(config.eos_token_id), dtype=torch.long, device=input_ids.device
            ),
            pad_token_id=config.pad_token_id if config.pad_token_id is not None else 0,
            assistant_model=assistant_model,
            prompt_lookup_num_tokens=config.prompt_lookup_num_tokens,
            processors=(
                VerifiedProcessors(parts.processors, input_ids) if parts.host_processors else None
            ),
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
        parts: GenerationParts,
        batch: int,
        step_keywords: dict[str, Any],
        kwargs: dict[str, Any],
    ) -> HostSampling | PluginTokens:
        """Where the tokens come from: an enabled feature's source, else the host. Processors
        a sampling graph does not apply need the logits on the host: with a model that returns
        them the host chooses the tokens; without, they are refused."""
        context = self.neuron_model.context
        config = parts.config
        source = context.token_source(config, batch, step_keywords, kwargs)
        if source is None:
            return HostSampling(parts, step_keywords)
        needs_host = [type(p).__name__ for p in parts.host_processors]
        if not needs_host:
            return PluginTokens(
                source, bool(config.return_dict_in_generate and config.output_scores)
            )
        if not getattr(self.neuron_model.neuron_config, "output_logits", False):
            raise NotSupportedError(
                f"{', '.join(needs_host)} (from the GenerationConfig or logits_processor) "
                "change the logits before a token is chosen, but this model chooses its tokens "
                "in its graph (on_device_sampling_config) and returns no logits; set "
                "NeuronConfig(output_logits=True) to choose them on the host from the logits, "
                "or build the model without on_device_sampling_config"
            )
        if "sampling_params" in step_keywords:
            raise NotSupportedError(
                f"{', '.join(needs_host)} make the host choose the tokens from the model's "
                "logits, with the GenerationConfig's do_sample / top_k / top_p / temperature; "
                "per-row sampling_params cannot be honoured there: leave them out"
            )
        return HostSampling(parts, source.step_keywords)
