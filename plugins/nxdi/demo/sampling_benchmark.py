"""NxD Inference's ``benchmark_sampling``: latency percentiles of whole generations and of each
sub-model, written as NxD Inference's JSON report.

The report maps ``e2e_model``, ``context_encoding_model`` and ``token_generation_model`` to
``latency_ms_p50/p90/p95/p99/p100``, ``latency_ms_avg`` (milliseconds) and ``throughput``
(tokens per second, counted as NxD Inference does: runs x tokens x ``max_batch_size`` over the
summed latency, with ``max_length`` tokens for a generation, ``max_context_length`` for context
encoding and ``max_new_tokens`` for token generation).

The timing is nxdplug's own (:func:`~nxdplug.plugins.benchmark.measurements.measure_nxdplug`): the
application is driven forward by forward from random prompts of ``max_context_length`` tokens
(half of it when that is ``max_length``), ``max_new_tokens`` new tokens per run, one warm-up run
first. A generation's latency runs from its first forward to its last token; context encoding's
is the first forward (with the first token's choice); token generation's, every later forward.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig

from nxdplug.plugin_api import (
    HF_DEFAULTS,
    NotSupportedError,
    NxdPlugError,
    model_generation_config,
    prepare_sampling_params,
)
from nxdplug.plugins.benchmark.measurements import measure_nxdplug, percentile, random_prompt_ids

if TYPE_CHECKING:
    from nxdplug.plugin_api import NeuronBaseForCausalLM, NeuronConfig

BENCHMARK_REPORT_PATH = "./benchmark_report.json"
END_TO_END_MODEL = "e2e_model"
CONTEXT_ENCODING_MODEL = "context_encoding_model"
TOKEN_GENERATION_MODEL = "token_generation_model"
# target -> the report entries it measures
TARGETS = {
    "all": (END_TO_END_MODEL, CONTEXT_ENCODING_MODEL, TOKEN_GENERATION_MODEL),
    "e2e": (END_TO_END_MODEL,),
    "context_encode": (CONTEXT_ENCODING_MODEL,),
    "token_gen": (TOKEN_GENERATION_MODEL,),
}
PERCENTILES = (50, 90, 95, 99, 100)


def generate_report(
    latency_list: Sequence[float], max_length: int, max_batch_size: int, n_runs: int = 20
) -> dict[str, float] | None:
    """NxD Inference's entry for one model: latencies (seconds in) as milliseconds out, and the
    throughput of ``n_runs`` runs of ``max_length`` tokens for ``max_batch_size`` rows; None for
    no latencies."""
    if not latency_list:
        return None
    report = {f"latency_ms_p{q}": percentile(latency_list, q) * 1000 for q in PERCENTILES}
    report["latency_ms_avg"] = statistics.fmean(latency_list) * 1000
    report["throughput"] = n_runs * max_length * max_batch_size / sum(latency_list)
    return report


def benchmark_sampling(
    model: NeuronBaseForCausalLM,
    draft_model: NeuronBaseForCausalLM | None = None,
    generation_config: GenerationConfig | None = None,
    target: str | None = None,
    image: Any = False,
    num_runs: int = 20,
    benchmark_report_path: str = BENCHMARK_REPORT_PATH,
) -> dict[str, dict[str, float] | None]:
    """Time ``num_runs`` generations of a loaded application; write the report to
    ``benchmark_report_path`` and return it.

    ``target`` ("all" by default, "e2e", "context_encode" or "token_gen") chooses the entries.
    A model that samples on device with ``dynamic`` is given the ``generation_config``'s
    ``top_k``, ``top_p`` and ``temperature`` as ``sampling_params`` (the model's own
    generation config when None); any other samples as its config says, or greedily on the
    host. Speculation (``draft_model``, a "speculation" target) and images are refused.
    """
    target = "all" if target is None else target
    if draft_model is not None or target == "speculation":
        raise NotSupportedError(
            "benchmark_sampling does not time speculation yet; `nxdplug benchmark` with "
            "--speculation-length does"
        )
    if image:
        raise NotSupportedError(
            "benchmark_sampling does not take images: nxdplug has no vision model"
        )
    if target not in TARGETS:
        raise NxdPlugError(f"target must be one of {sorted(TARGETS)} or None; got {target!r}")
    if not isinstance(num_runs, int) or num_runs < 1:
        raise NxdPlugError(f"num_runs must be a whole number, 1 or more; got {num_runs!r}")
    neuron_config = model.neuron_config
    prompt_length, new_tokens = _lengths(neuron_config)
    if target == "context_encode":
        new_tokens = 1
    elif target in ("all", "token_gen") and new_tokens < 2:
        raise NxdPlugError(
            f"max_new_tokens={new_tokens} leaves no token-generation step to time; "
            "set max_new_tokens to 2 or more"
        )
    torch.manual_seed(0)
    input_ids = random_prompt_ids(model.config.vocab_size, neuron_config.batch_size, prompt_length)
    keywords = _step_keywords(model, generation_config)
    runs = measure_nxdplug(model, input_ids, new_tokens, num_runs, step_keywords=keywords)
    model.reset()
    latencies = {
        END_TO_END_MODEL: [run.e2e for run in runs],
        CONTEXT_ENCODING_MODEL: [run.ttft for run in runs],
        TOKEN_GENERATION_MODEL: [step for run in runs for step in run.steps],
    }
    tokens = {
        END_TO_END_MODEL: neuron_config.max_length,
        CONTEXT_ENCODING_MODEL: neuron_config.max_context_length,
        TOKEN_GENERATION_MODEL: new_tokens,
    }
    report = {
        name: generate_report(
            latencies[name], tokens[name], neuron_config.max_batch_size, n_runs=num_runs
        )
        for name in TARGETS[target]
    }
    Path(benchmark_report_path).write_text(json.dumps(report))
    return report


def _lengths(neuron_config: NeuronConfig) -> tuple[int, int]:
    """NxD Inference's benchmark prompt length, and the new tokens that fit after it."""
    prompt_length = neuron_config.max_context_length
    if prompt_length >= neuron_config.max_length:
        prompt_length //= 2
    room = neuron_config.max_length - prompt_length
    return prompt_length, min(neuron_config.max_new_tokens or room, room)


def _step_keywords(
    model: NeuronBaseForCausalLM, generation_config: GenerationConfig | None
) -> dict[str, Any]:
    """``sampling_params`` for a model whose on-device sampler takes them per row."""
    sampling_config = model.neuron_config.on_device_sampling_config
    if sampling_config is None or not sampling_config.dynamic:
        return {}
    config = generation_config or model_generation_config(model)
    if not config.do_sample:
        settings = {"top_k": 1, "top_p": 1.0, "temperature": 1.0}
    else:
        settings = {
            name: getattr(config, name, None) or HF_DEFAULTS[name]
            for name in ("top_k", "top_p", "temperature")
        }
    batch_size = model.neuron_config.batch_size
    return {"sampling_params": prepare_sampling_params(batch_size, **settings)}
