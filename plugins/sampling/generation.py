"""``generate()`` with on-device sampling: the model's own tokens, and the GenerationConfig's
``do_sample``, ``top_k``, ``top_p`` and ``temperature`` as its ``sampling_params``.

With ``dynamic=True`` the model is given the caller's ``sampling_params`` as they are, or by
default the GenerationConfig's settings as one row per request; otherwise it samples with its
config's settings, and ``generate()`` arguments asking for other ones are refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig

from nxdplug.plugin_api import NotSupportedError, SamplingParams, get_registry
from nxdplug.plugins.sampling.on_device import samples, sampling_params_tensor

if TYPE_CHECKING:
    from nxdplug.plugin_api import PipelineContext

# GenerationConfig settings that on-device sampling takes as sampling_params.
SAMPLING_SETTINGS = ("do_sample", "top_k", "top_p", "temperature")


class DeviceSampling:
    """Tokens the model sampled itself.

    ``step_keywords`` hold the ``sampling_params`` the model's forward is given (none: its
    config's settings); ``rows`` are the settings each row is sampled with, for the scores.
    """

    def __init__(self, step_keywords: dict[str, Any], rows: torch.Tensor, greedy: bool) -> None:
        self.step_keywords = step_keywords
        self.rows = rows
        self.greedy = greedy
        self.multinomial = get_registry().get("samplers", "multinomial").load("implementation")()

    def next_tokens(self, outputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = None if outputs.logits is None else outputs.logits[:, -1, :]
        return outputs.tokens[:, -1], logits

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """HF's processed scores of each row's settings (the logits when decoding greedily)."""
        if self.greedy:
            return logits
        return torch.cat(
            [
                self.multinomial.scores(
                    logits[row : row + 1],
                    SamplingParams(top_k=int(top_k), top_p=top_p, temperature=temperature),
                )
                for row, (top_k, top_p, temperature) in enumerate(self.rows.tolist())
            ]
        )


def device_token_source(
    context: PipelineContext,
    generation_config: GenerationConfig,
    batch_size: int,
    step_keywords: dict[str, Any],
    generate_kwargs: dict[str, Any],
) -> DeviceSampling:
    """Where ``generate()`` takes tokens from when the model samples on the device."""
    neuron_config = context.neuron_config
    sampling_config = neuron_config.on_device_sampling_config
    config = generation_config
    wants_logits = config.output_scores or config.output_logits
    if config.return_dict_in_generate and wants_logits and not neuron_config.output_logits:
        raise NotSupportedError(
            "output_scores and output_logits need the model's logits, which a model with "
            "on-device sampling returns only with NeuronConfig(output_logits=True); set it, "
            "or leave them off"
        )
    greedy = not samples(sampling_config)
    given = step_keywords.get("sampling_params")
    if given is not None:
        return DeviceSampling(step_keywords, given, greedy)
    if sampling_config.dynamic:
        rows = _sampling_rows(context, config, batch_size)
        greedy = not config.do_sample  # HF's greedy scores are the logits
        return DeviceSampling(step_keywords | {"sampling_params": rows}, rows, greedy)
    _refuse_other_settings(sampling_config, generate_kwargs)
    rows = sampling_params_tensor(
        batch_size,
        sampling_config.top_k,
        sampling_config.top_p,
        sampling_config.temperature,
        context.device,
    )
    return DeviceSampling(step_keywords, rows, greedy)


def _sampling_rows(context: PipelineContext, config: GenerationConfig, batch: int) -> torch.Tensor:
    """The GenerationConfig's settings as ``sampling_params``, one row per request."""
    if not config.do_sample:
        return sampling_params_tensor(batch, 1, 1.0, 1.0, context.device)
    sampling_config = context.neuron_config.on_device_sampling_config  # dynamic: it samples
    top_k = config.top_k
    if not top_k:  # HF: top_k 0 keeps every token
        global_topk = sampling_config.global_topk
        vocab_size = context.config.vocab_size
        if global_topk < vocab_size:
            raise NotSupportedError(
                f"top_k={top_k!r} keeps every token, but on-device sampling draws from the "
                f"global_topk={global_topk} best; pass top_k={global_topk} or less, or set "
                f"global_topk to the vocab_size ({vocab_size})"
            )
        top_k = vocab_size
    return sampling_params_tensor(batch, top_k, config.top_p, config.temperature, context.device)


def _refuse_other_settings(sampling_config: Any, kwargs: dict[str, Any]) -> None:
    """Without dynamic sampling the config's settings are used: refuse others asked for."""
    given = {name: kwargs[name] for name in SAMPLING_SETTINGS if name in kwargs}
    if not (given.get("do_sample", sampling_config.do_sample) or sampling_config.do_sample):
        return  # greedy either way
    differing = [
        f"{name}={value!r} (the model's: {getattr(sampling_config, name)!r})"
        for name, value in given.items()
        if value != getattr(sampling_config, name)
    ]
    if differing:
        raise NotSupportedError(
            "the model samples on the device with its on_device_sampling_config settings "
            f"(dynamic=False), but generate() was asked for {', '.join(differing)}; leave "
            "them out, or set dynamic=True to choose them per call"
        )
