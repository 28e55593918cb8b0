"""Latency and throughput of greedy generation, nxdplug against HF transformers.

The nxdplug model is driven directly (``reset()``, one forward for the prompt, one per new
token), so context encoding and token generation are timed apart. HF's ``generate()`` is timed
through a streamer that stamps every token it is handed. Both give one :class:`RunTimes` per
generation: ``perf_counter`` at the start, after each new token and at the end; every statistic
is derived from those stamps the same way for both.

The ceiling is the memory-bandwidth bound of decoding: each token-generation step reads every
weight once plus the KV cache held so far, so it cannot produce more than
``batch * bandwidth / bytes_per_step`` tokens per second. Context encoding has a compute
ceiling instead, in :mod:`nxdplug.plugins.benchmark.roofline`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import nn

from nxdplug.plugin_api import NxdPlugError, greedy_tokens, head_dim_of, huge_page_buffer
from nxdplug.plugins.benchmark.roofline import GEMM_SIZE, PrefillCeiling

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, NeuronBaseForCausalLM

PROMPT_SEED = 0
BANDWIDTH_BYTES = 2**28
BANDWIDTH_REPEATS = 5
# The output projection of a model with tied embeddings: a parameter of its own in the nxdplug
# models, but the same matrix as the input embedding, so read once per step.
TIED_OUTPUT_WEIGHT = "lm_head.weight"


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks.

    This is the "inclusive" definition (numpy's default, ``statistics.quantiles(...,
    method="inclusive")``): the sorted values sit at ranks 0..n-1 and percentile q is read at
    rank ``(n - 1) * q / 100``, so p0 is the minimum, p100 the maximum, and p50 the median.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within 0..100; got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


@attrs.frozen
class LatencyStats:
    """Percentiles of a set of latencies, in the unit of the samples."""

    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def from_samples(cls, samples: Sequence[float]) -> LatencyStats:
        return cls(
            p50=percentile(samples, 50),
            p90=percentile(samples, 90),
            p99=percentile(samples, 99),
            count=len(samples),
        )


@attrs.frozen
class RunTimes:
    """One generation: ``perf_counter`` at its start, after each new token, and at its end."""

    start: float
    tokens: tuple[float, ...]
    end: float

    @property
    def ttft(self) -> float:
        """Time to first token: context encoding and the first token's selection."""
        return self.tokens[0] - self.start

    @property
    def steps(self) -> list[float]:
        """The time of each token-generation step (every token after the first)."""
        return [later - earlier for earlier, later in itertools.pairwise(self.tokens)]

    @property
    def e2e(self) -> float:
        return self.end - self.start


@attrs.frozen
class GenerationStats:
    """What a set of runs of one system measured, in seconds.

    TTFT and end-to-end latency are medians over runs; the per-token percentiles are over every
    token-generation step of every run.
    """

    batch_size: int
    new_tokens: int
    ttft: float
    per_token: LatencyStats
    e2e: float

    @classmethod
    def from_runs(cls, runs: Sequence[RunTimes], batch_size: int) -> GenerationStats:
        steps = [step for run in runs for step in run.steps]
        if not steps:
            raise NxdPlugError("no token-generation step was timed; generate 2 tokens or more")
        return cls(
            batch_size=batch_size,
            new_tokens=len(runs[0].tokens),
            ttft=statistics.median(run.ttft for run in runs),
            per_token=LatencyStats.from_samples(steps),
            e2e=statistics.median(run.e2e for run in runs),
        )

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second of token generation alone: a batch per median step."""
        return self.batch_size / self.per_token.p50

    @property
    def throughput_tokens_per_s(self) -> float:
        """Generated tokens per second of a whole generation, context encoding included."""
        return self.batch_size * self.new_tokens / self.e2e

    def to_dict(self) -> dict[str, float]:
        return {
            "ttft_ms": self.ttft * 1e3,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "per_token_p50_ms": self.per_token.p50 * 1e3,
            "per_token_p90_ms": self.per_token.p90 * 1e3,
            "per_token_p99_ms": self.per_token.p99 * 1e3,
            "e2e_ms": self.e2e * 1e3,
            "throughput_tokens_per_s": self.throughput_tokens_per_s,
        }


def random_prompt_ids(
    vocab_size: int, batch_size: int, length: int, seed: int = PROMPT_SEED
) -> torch.Tensor:
    """Seeded random prompts [batch, length] of ids 1..vocab-1 (0 is often a special token)."""
    if vocab_size < 2:
        raise NxdPlugError(f"a vocabulary of {vocab_size} token(s) leaves no id to prompt with")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (batch_size, length), generator=generator)


def _run_nxdplug(
    model: NeuronBaseForCausalLM,
    input_ids: torch.Tensor,
    new_tokens: int,
    step_keywords: Mapping[str, Any],
) -> RunTimes:
    model.reset()
    mask = torch.ones_like(input_ids)
    step_input = input_ids
    stamps = []
    start = time.perf_counter()
    for _ in range(new_tokens):
        outputs = model(input_ids=step_input, attention_mask=mask, **step_keywords)
        # A model that samples on device returns its tokens; otherwise take the greedy one here.
        step_input = outputs.tokens
        if step_input is None:
            step_input = greedy_tokens(outputs.logits[:, -1:, :])
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
        stamps.append(time.perf_counter())
    return RunTimes(start=start, tokens=tuple(stamps), end=stamps[-1])


def measure_nxdplug(
    model: NeuronBaseForCausalLM,
    input_ids: torch.Tensor,
    new_tokens: int,
    runs: int,
    warmup: int = 1,
    step_keywords: Mapping[str, Any] | None = None,
) -> tuple[RunTimes, ...]:
    """Greedy generation of exactly ``new_tokens`` tokens by a loaded NeuronBaseForCausalLM.

    The first forward after ``reset()`` is context encoding, each later one a token-generation
    step; end-of-sequence tokens are not looked for. ``warmup`` untimed runs come first.
    ``step_keywords`` (a plugin's per-row inputs, e.g. ``adapter_ids``) go to every step.
    """
    keywords = dict(step_keywords or {})
    with torch.inference_mode():
        for _ in range(warmup):
            _run_nxdplug(model, input_ids, new_tokens, keywords)
        return tuple(_run_nxdplug(model, input_ids, new_tokens, keywords) for _ in range(runs))


class _TimestampStreamer:
    """A ``generate()`` streamer that only records when each ``put()`` happens.

    HF calls ``put()`` with the prompt first, then once per new token, right after selecting it.
    """

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def _run_hf(
    hf_model: nn.Module,
    input_ids: torch.Tensor,
    new_tokens: int,
    generate_kwargs: Mapping[str, Any],
) -> RunTimes:
    streamer = _TimestampStreamer()
    pad_token_id = hf_model.generation_config.pad_token_id
    if pad_token_id is None:
        pad_token_id = 0  # any id: with min_new_tokens no row finishes, so no row is padded
    start = time.perf_counter()
    hf_model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_token_id,
        streamer=streamer,
        **generate_kwargs,
    )
    end = time.perf_counter()
    tokens = tuple(streamer.stamps[1:])
    if len(tokens) != new_tokens:
        raise NxdPlugError(
            f"HF generate() streamed {len(tokens)} new tokens instead of {new_tokens}; "
            "its timings cannot be compared"
        )
    return RunTimes(start=start, tokens=tokens, end=end)


def measure_hf(
    hf_model: nn.Module,
    input_ids: torch.Tensor,
    new_tokens: int,
    runs: int,
    warmup: int = 1,
    generate_kwargs: Mapping[str, Any] | None = None,
) -> tuple[RunTimes, ...]:
    """HF transformers' greedy ``generate()`` of exactly ``new_tokens`` tokens.

    ``min_new_tokens`` equal to ``max_new_tokens`` keeps an end-of-sequence token from ending a
    run early. ``warmup`` untimed runs come first. ``generate_kwargs`` are added to every call
    (PEFT's ``adapter_names``, ...).
    """
    kwargs = dict(generate_kwargs or {})
    with torch.inference_mode():
        for _ in range(warmup):
            _run_hf(hf_model, input_ids, new_tokens, kwargs)
        return tuple(_run_hf(hf_model, input_ids, new_tokens, kwargs) for _ in range(runs))


def compile_hf_generation(hf_model: nn.Module) -> nn.Module:
    """HF transformers' documented recipe for fast generation ("Static kv-cache and
    torch.compile" in its inference-optimization guide), applied to ``hf_model`` in place: a
    static KV cache, so that every decode step has the same shapes, and ``forward`` compiled as
    one graph. The guide's ``mode="reduce-overhead"`` adds CUDA graphs, which a CPU has none of,
    so torch.compile's default mode is used. Nothing compiles until the first ``generate()``.

    Of a PEFT model the base model is compiled: its ``generate()`` calls that model's forward.
    """
    get_base_model = getattr(hf_model, "get_base_model", None)
    target = get_base_model() if callable(get_base_model) else hf_model
    target.generation_config.cache_implementation = "static"
    target.forward = torch.compile(target.forward, fullgraph=True)
    return hf_model


def measure_alternating(
    model: NeuronBaseForCausalLM,
    hf_systems: Mapping[str, tuple[nn.Module, Mapping[str, Any]]],
    input_ids: torch.Tensor,
    new_tokens: int,
    runs: int,
    step_keywords: Mapping[str, Any] | None = None,
    base: NeuronBaseForCausalLM | None = None,
) -> tuple[dict[str, tuple[RunTimes, ...]], dict[str, float]]:
    """nxdplug's runs, those of ``base`` (another application, timed without
    ``step_keywords``) and those of each HF system (name: model and ``generate()`` keywords)
    taken in turn after a warm-up of each, so that load from other processes on a shared
    machine falls on all alike and their ratios stay meaningful.

    Returns the runs and the seconds of each warm-up by system name (``"nxdplug"``, ``"base"``
    and the ``hf_systems`` keys); a torch.compile'd HF model compiles in its warm-up, so that
    time is in neither its runs nor its statistics. An HF system that fails in its warm-up is
    one :class:`NxdPlugError` naming it.
    """

    def ours(runs: int, warmup: int) -> tuple[RunTimes, ...]:
        return measure_nxdplug(model, input_ids, new_tokens, runs, warmup, step_keywords)

    def theirs(name: str, runs: int, warmup: int) -> tuple[RunTimes, ...]:
        hf_model, hf_kwargs = hf_systems[name]
        return measure_hf(hf_model, input_ids, new_tokens, runs, warmup, hf_kwargs)

    timers: dict[str, Callable[..., tuple[RunTimes, ...]]] = {"nxdplug": ours}
    if base is not None:
        timers["base"] = lambda runs, warmup: measure_nxdplug(
            base, input_ids, new_tokens, runs, warmup
        )
    for name in hf_systems:
        timers[name] = lambda runs, warmup, name=name: theirs(name, runs, warmup)
    warmups = {}
    for name, timer in timers.items():
        try:
            warmups[name] = _seconds(lambda timer=timer: timer(runs=0, warmup=1))
        except Exception as exc:  # torch.compile raises from many places; report any of them
            if name not in hf_systems:
                raise
            first_line = (str(exc).strip().splitlines() or [""])[0][:300]
            raise NxdPlugError(
                f"HF transformers ({name}) failed in its warm-up, so no table is printed: "
                f"{type(exc).__name__}: {first_line}"
            ) from exc
    times: dict[str, list[RunTimes]] = {name: [] for name in timers}
    for _ in range(runs):
        for name, timer in timers.items():
            times[name] += timer(runs=1, warmup=0)
    return {name: tuple(runs) for name, runs in times.items()}, warmups


def _seconds(work: Any) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def measure_read_bandwidth(
    nbytes: int = BANDWIDTH_BYTES, repeats: int = BANDWIDTH_REPEATS
) -> float:
    """Memory read bandwidth in GB/s (1e9 bytes): the best of ``repeats`` timed ``sum()`` over a
    float32 tensor of ``nbytes``, on torch's current threads, in huge pages where the loaded
    models' weights are (:func:`nxdplug.plugin_api.huge_page_buffer`): in the allocator's 4 KiB
    pages it reads slower than the weights are read.

    ``sum()`` reads every byte once and writes nothing, as a decode step reads its weights; a
    copy would add as many writes. The tensor must be much larger than the caches (the default,
    256 MiB, is) for this to measure memory rather than cache.
    """
    count = max(nbytes // 4, 1)
    buffer = huge_page_buffer(count * 4)
    data = torch.empty(count) if buffer is None else buffer.view(torch.float32)
    data.fill_(1.0)
    data.sum()  # touch every page before timing
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * data.element_size() / best / 1e9


@attrs.frozen
class DecodeBytes:
    """Bytes one token-generation step has to read."""

    weights: int
    kv_cache: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache


def weight_bytes(module: nn.Module, dtype: torch.dtype, tie_word_embeddings: bool = False) -> int:
    """Bytes of the module's parameters with floating ones in ``dtype``, a tied weight once.

    Parameters shared as one tensor count once already; with ``tie_word_embeddings`` the output
    projection (``lm_head.weight``) is left out too, since it is the input embedding.
    """
    return sum(
        parameter.numel()
        * (dtype.itemsize if parameter.is_floating_point() else parameter.element_size())
        for name, parameter in module.named_parameters()
        if not (tie_word_embeddings and name.endswith(TIED_OUTPUT_WEIGHT))
    )


def decode_weight_bytes(
    module: nn.Module, dtype: torch.dtype, batch_size: int, tie_word_embeddings: bool = False
) -> int:
    """The weight bytes one decode step of ``batch_size`` rows reads: :func:`weight_bytes`,
    except for submodules that read only part of their weights per step (routed experts) and
    say how much through a ``decode_weight_bytes(batch_size, dtype)`` method."""
    partial = {
        name: sub
        for name, sub in module.named_modules()
        if name and callable(getattr(sub, "decode_weight_bytes", None))
    }
    outermost = [n for n in partial if not any(n.startswith(f"{o}.") for o in partial)]
    inside = tuple(f"{name}." for name in outermost)
    whole = sum(
        parameter.numel()
        * (dtype.itemsize if parameter.is_floating_point() else parameter.element_size())
        for name, parameter in module.named_parameters()
        if not name.startswith(inside)
        and not (tie_word_embeddings and name.endswith(TIED_OUTPUT_WEIGHT))
    )
    return whole + sum(partial[n].decode_weight_bytes(batch_size, dtype) for n in outermost)


def kv_cache_bytes(config: InferenceConfig, batch_size: int, positions: float) -> float:
    """Bytes of keys and values of ``positions`` cached tokens for every layer and row."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    itemsize = config.neuron_config.torch_dtype.itemsize
    per_position = 2 * config.num_hidden_layers * heads * head_dim_of(config) * itemsize
    return batch_size * per_position * positions


def mean_decode_positions(prompt_length: int, new_tokens: int) -> float:
    """The mean number of cached positions a token-generation step attends to.

    Step k (1..new_tokens-1) feeds token k, which attends to ``prompt_length + k`` positions;
    the mean over the steps is ``prompt_length + new_tokens / 2``.
    """
    return prompt_length + new_tokens / 2


def decode_bytes_per_step(
    model: NeuronBaseForCausalLM, batch_size: int, positions: float
) -> DecodeBytes:
    """What one token-generation step of a NeuronBaseForCausalLM reads: every weight in the
    config's dtype (a tied one once; of an untied input embedding, only the rows of the batch;
    of routed experts, those a step can route to) and the KV cache of ``positions`` tokens per
    row.

    The weights are counted on the model class built on the meta device and transformed by the
    enabled plugins (8-bit weights count one byte each), so the count is the same whether the
    model runs eagerly or from compiled graphs, and costs no memory.
    """
    config = model.config
    skeleton = weights_skeleton(model)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    dtype = config.neuron_config.torch_dtype
    weights = decode_weight_bytes(skeleton, dtype, batch_size, tied)
    if not tied:
        # A step reads one embedding row per sequence; the LM head, a separate table, is read
        # whole. (Tied, the one table is read whole by the LM head.)
        table = skeleton.embed_tokens.weight
        weights -= (table.shape[0] - batch_size) * table.shape[1] * dtype.itemsize
    return DecodeBytes(
        weights=weights,
        kv_cache=round(kv_cache_bytes(config, batch_size, positions)),
    )


def reset_peak_rss() -> None:
    """Start the process's peak resident memory (VmHWM) afresh, where Linux allows it."""
    # Not Linux, or not allowed: the peak then counts from the process's start.
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int | None:
    """The process's peak resident memory since its start or :func:`reset_peak_rss`."""
    return _process_status_bytes("VmHWM")


def rss_bytes() -> int | None:
    """The process's resident memory now."""
    return _process_status_bytes("VmRSS")


def _process_status_bytes(field: str) -> int | None:
    """A memory figure of /proc/self/status (Linux), in bytes; None elsewhere."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return None


def model_weight_bytes(model: NeuronBaseForCausalLM) -> int:
    """Bytes of every weight the loaded model holds (as the plugins transformed it)."""
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return weight_bytes(weights_skeleton(model), config.neuron_config.torch_dtype, tied)


def weights_skeleton(model: NeuronBaseForCausalLM) -> nn.Module:
    """The application's model class built on the meta device (no memory, no KV cache) and
    transformed by the enabled plugins, for counting its weights."""
    from nxdplug.plugin_api import parameters_on_meta

    with parameters_on_meta(), model.context.active():
        skeleton = model.context_encoding_model.model_cls(model.config, optimize_inference=False)
        model.context.transform_model(skeleton)
    return skeleton


# The systems a report can hold, in column order, and their column labels (one word each).
SYSTEM_LABELS = {"nxdplug": "nxdplug", "base": "base", "hf": "HF", "hf_compiled": "HF-compiled"}

# (label, key in GenerationStats.to_dict(), format)
_TABLE_ROWS = (
    ("TTFT (ms)", "ttft_ms", "{:.2f}"),
    ("decode (tok/s)", "decode_tokens_per_s", "{:.1f}"),
    ("per-token p50 (ms)", "per_token_p50_ms", "{:.3f}"),
    ("per-token p90 (ms)", "per_token_p90_ms", "{:.3f}"),
    ("per-token p99 (ms)", "per_token_p99_ms", "{:.3f}"),
    ("end-to-end (ms)", "e2e_ms", "{:.1f}"),
    ("throughput (tok/s)", "throughput_tokens_per_s", "{:.1f}"),
)


@attrs.frozen
class BenchmarkReport:
    """One benchmark: its configuration, each system's statistics (nxdplug's; the base
    model's, HF's eager ``generate()``, and with a static cache and torch.compile, when
    measured), the bandwidth ceiling of decoding and the compute ceiling of prefill.

    The base model is the same checkpoint and config without the settings that enable the
    command line's feature plugins (``config["base"]`` names them); the ceilings are
    nxdplug's."""

    config: dict[str, Any]
    nxdplug: GenerationStats
    hf: GenerationStats | None
    read_gb_per_s: float
    bytes_per_step: DecodeBytes
    mean_positions: float
    peak_rss: int | None = None  # bytes, the process's peak once the model was loaded
    weight_bytes: int | None = None  # bytes of every weight the model holds
    rss_before_load: int | None = None  # bytes resident before the weights were loaded
    rss_loaded: int | None = None  # bytes resident once loaded
    hf_compiled: GenerationStats | None = None  # HF with a static cache and torch.compile
    warmup_seconds: dict[str, float] = attrs.field(factory=dict)  # by system, compile included
    prefill: PrefillCeiling | None = None
    base: GenerationStats | None = None

    @property
    def ceiling_tokens_per_s(self) -> float:
        """Decode tokens/s if every step only streamed its bytes at the measured bandwidth."""
        return self.nxdplug.batch_size * self.read_gb_per_s * 1e9 / self.bytes_per_step.total

    def systems(self) -> dict[str, GenerationStats]:
        """The measured systems by name, in :data:`SYSTEM_LABELS` order."""
        every = {
            "nxdplug": self.nxdplug,
            "base": self.base,
            "hf": self.hf,
            "hf_compiled": self.hf_compiled,
        }
        return {name: stats for name, stats in every.items() if stats is not None}

    def baselines(self) -> list[str]:
        """The measured systems besides nxdplug, each a pair of columns in the table."""
        return [name for name in self.systems() if name != "nxdplug"]

    def ratios(self, baseline: str = "hf") -> dict[str, float] | None:
        """nxdplug / ``baseline`` (a system's name) for every reported number (above 1 is
        faster for tokens/s, slower for latencies); None when it was not measured."""
        theirs = self.systems().get(baseline)
        if theirs is None:
            return None
        ours, theirs = self.nxdplug.to_dict(), theirs.to_dict()
        return {key: ours[key] / theirs[key] for key in ours}

    def to_dict(self) -> dict[str, Any]:
        ceiling = self.ceiling_tokens_per_s
        systems = self.systems()
        return {
            "config": dict(self.config),
            "nxdplug": self.nxdplug.to_dict(),
            "base": self.base.to_dict() if self.base else None,
            "hf": self.hf.to_dict() if self.hf else None,
            "hf_compiled": self.hf_compiled.to_dict() if self.hf_compiled else None,
            "ratios": self.ratios("hf"),
            "ratios_hf_compiled": self.ratios("hf_compiled"),
            "ratios_base": self.ratios("base"),
            "warmup_s": dict(self.warmup_seconds),
            "bandwidth": {
                "read_gb_per_s": self.read_gb_per_s,
                "weight_bytes": self.bytes_per_step.weights,
                "kv_cache_bytes_per_step": self.bytes_per_step.kv_cache,
                "bytes_per_step": self.bytes_per_step.total,
                "mean_positions": self.mean_positions,
                "ceiling_tokens_per_s": ceiling,
                "fraction_of_ceiling": {
                    name: stats.decode_tokens_per_s / ceiling for name, stats in systems.items()
                },
            },
            "compute": self.prefill.to_dict({n: s.ttft for n, s in systems.items()})
            if self.prefill
            else None,
            "memory": {
                "peak_rss_bytes": self.peak_rss,
                "rss_before_load_bytes": self.rss_before_load,
                "rss_loaded_bytes": self.rss_loaded,
                "model_weight_bytes": self.weight_bytes,
            },
        }

    def format_table(self) -> str:
        report = self.to_dict()
        baselines = self.baselines()
        ratios = {name: self.ratios(name) for name in baselines}
        header = ["", "nxdplug"]
        for name in baselines:
            header += [SYSTEM_LABELS[name], f"nxdplug/{SYSTEM_LABELS[name]}"]
        rows = [header]
        for label, key, fmt in _TABLE_ROWS:
            row = [label, fmt.format(report["nxdplug"][key])]
            for name in baselines:
                row += [fmt.format(report[name][key]), f"{ratios[name][key]:.2f}"]
            rows.append(row)
        rows.append(self._fractions_row("of ceiling", report["bandwidth"], baselines))
        if report["compute"]:
            rows.append(self._fractions_row("prefill of ceiling", report["compute"], baselines))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        table = [
            "  ".join(
                [r[0].ljust(widths[0])]
                + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
            )
            for r in rows
        ]
        return "\n".join(
            [
                *self._config_lines(),
                "",
                *self._headline(),
                *table,
                "",
                *self._ceiling_lines(),
                *self._warmup_lines(),
            ]
        )

    @staticmethod
    def _fractions_row(label: str, ceiling: dict[str, Any], baselines: list[str]) -> list[str]:
        """Each system's fraction of a ceiling, and nxdplug's over each baseline's."""
        fractions = ceiling["fraction_of_ceiling"]
        row = [label, f"{fractions['nxdplug']:.1%}"]
        for name in baselines:
            row += [f"{fractions[name]:.1%}", f"{fractions['nxdplug'] / fractions[name]:.2f}"]
        return row

    def _config_lines(self) -> list[str]:
        c = self.config
        return [
            f"model     {c['model']}",
            f"dtype     {c['dtype']}, batch {c['batch_size']}, prompt {c['prompt_length']} + "
            f"{c['new_tokens']} new tokens, {c['runs']} timed run(s) after 1 warm-up",
            f"backend   {c['backend']}, torch {c['torch']}, {c['threads']} thread(s)",
            *([f"base      the same config without {c['base']}"] if "base" in c else []),
        ]

    def _headline(self) -> list[str]:
        lines = []
        for name in self.baselines():
            ratios = self.ratios(name)
            lines.append(
                f"nxdplug/{SYSTEM_LABELS[name]}: decode tok/s "
                f"x{ratios['decode_tokens_per_s']:.2f}, TTFT x{ratios['ttft_ms']:.2f}, "
                f"end-to-end x{ratios['e2e_ms']:.2f}"
            )
        return [*lines, ""] if lines else []

    def _ceiling_lines(self) -> list[str]:
        b = self.bytes_per_step
        return [
            f"read bandwidth  {self.read_gb_per_s:.1f} GB/s (best timed sum() of a large tensor)",
            f"bytes per step  {b.total / 1e6:.2f} MB = {b.weights / 1e6:.2f} MB weights + "
            f"{b.kv_cache / 1e6:.2f} MB KV cache ({self.mean_positions:g} positions on average)",
            f"ceiling         {self.ceiling_tokens_per_s:.1f} decode tok/s",
            *self._prefill_lines(),
            *self._memory_lines(),
        ]

    def _prefill_lines(self) -> list[str]:
        if self.prefill is None:
            return []
        flops, gflop, n = self.prefill.flops, 1e9, GEMM_SIZE
        return [
            f"GEMM peak       {self.prefill.gemm_flops_per_s / gflop:.1f} GFLOP/s (best timed "
            f"{n}x{n}x{n} product in {self.config['dtype']}, torch.mm or oneDNN's prepacked)",
            f"FLOPs/prefill   {flops.total / gflop:.4g} GFLOP = {flops.weights / gflop:.4g} "
            f"weights + {flops.attention / gflop:.4g} causal attention + "
            f"{flops.lm_head / gflop:.4g} LM head (last token of each row)",
            f"prefill floor   {self.prefill.ttft_floor * 1e3:.2f} ms TTFT at the GEMM peak",
        ]

    def _warmup_lines(self) -> list[str]:
        if not self.warmup_seconds:
            return []
        parts = ", ".join(f"{SYSTEM_LABELS[n]} {s:.1f} s" for n, s in self.warmup_seconds.items())
        compiled = "; HF-compiled's includes torch.compile" if self.hf_compiled else ""
        return [f"warm-up         {parts} (1 untimed run each{compiled})"]

    def _memory_lines(self) -> list[str]:
        if self.peak_rss is None or not self.weight_bytes:
            return []
        lines = [
            f"peak RSS        {self.peak_rss / 1e6:.1f} MB once loaded (the process, Python and "
            f"torch included) = {self.peak_rss / self.weight_bytes:.2f}x the model's "
            f"{self.weight_bytes / 1e6:.1f} MB of weights"
        ]
        if self.rss_before_load is not None and self.rss_loaded is not None:
            held = self.rss_loaded - self.rss_before_load
            lines.append(
                f"model RSS       {held / 1e6:.1f} MB = {held / self.weight_bytes:.2f}x the "
                f"weights (RSS {self.rss_loaded / 1e6:.1f} MB loaded and warmed up, "
                f"{self.rss_before_load / 1e6:.1f} MB before loading)"
            )
        return lines


@attrs.frozen
class SpeculationReport:
    """Whole generations with and without speculation on the same target and prompts.

    Tokens/s are medians over runs of ``generate()`` (context encoding included); the
    acceptance is summed over the speculative runs.
    """

    config: dict[str, Any]
    plain_seconds: tuple[float, ...]
    speculative_seconds: tuple[float, ...]
    acceptance: dict[str, float]
    hf_speculative_seconds: tuple[float, ...] | None = None

    def tokens_per_s(self, seconds: Sequence[float]) -> float:
        tokens = self.config["batch_size"] * self.config["new_tokens"]
        return tokens / statistics.median(seconds)

    def to_dict(self) -> dict[str, Any]:
        plain = self.tokens_per_s(self.plain_seconds)
        speculative = self.tokens_per_s(self.speculative_seconds)
        report = {
            "config": dict(self.config),
            "plain_tokens_per_s": plain,
            "speculative_tokens_per_s": speculative,
            "speedup": speculative / plain,
            "acceptance": dict(self.acceptance),
        }
        if self.hf_speculative_seconds:
            hf = self.tokens_per_s(self.hf_speculative_seconds)
            report["hf_speculative_tokens_per_s"] = hf
            report["ratio_to_hf_speculative"] = speculative / hf
        return report

    def format_table(self) -> str:
        report, c = self.to_dict(), self.config
        a = report["acceptance"]
        hf = []
        if "hf_speculative_tokens_per_s" in report:
            hf = [
                f"HF, same speculation  {report['hf_speculative_tokens_per_s']:.1f} tok/s "
                f"(nxdplug/HF x{report['ratio_to_hf_speculative']:.2f})"
            ]
        return "\n".join(
            [
                f"model        {c['model']}",
                f"speculation  {c['mode']}, {c['proposer']}",
                f"dtype        {c['dtype']}, batch {c['batch_size']}, prompt {c['prompt_length']} "
                f"+ {c['new_tokens']} new tokens, {c['runs']} timed run(s) each after 1 warm-up",
                f"backend      {c['backend']}, torch {c['torch']}, {c['threads']} thread(s)",
                "",
                f"without speculation  {report['plain_tokens_per_s']:.1f} tok/s",
                f"with speculation     {report['speculative_tokens_per_s']:.1f} tok/s",
                *hf,
                f"speedup              x{report['speedup']:.2f}",
                f"acceptance           {a['mean_accepted_per_call']:.2f} accepted tokens per "
                f"target call ({a['tokens_per_call']:.2f} tokens per call), acceptance rate "
                f"{a['acceptance_rate']:.1%}",
            ]
        )


def _time_generate(
    model: NeuronBaseForCausalLM, input_ids: torch.Tensor, new_tokens: int, **kwargs: Any
) -> float:
    from nxdplug.plugin_api import HuggingFaceGenerationAdapter

    adapter = HuggingFaceGenerationAdapter(model)
    start = time.perf_counter()
    adapter.generate(
        input_ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, **kwargs
    )
    return time.perf_counter() - start


def _time_hf_generate(
    hf_model: nn.Module, input_ids: torch.Tensor, new_tokens: int, **kwargs: Any
) -> float:
    """Seconds of HF transformers' greedy ``generate()`` of exactly ``new_tokens`` tokens."""
    start = time.perf_counter()
    hf_model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=hf_model.generation_config.pad_token_id or 0,
        **kwargs,
    )
    return time.perf_counter() - start


def measure_speculation(
    plain: Any,
    speculative: Any,
    input_ids: torch.Tensor,
    new_tokens: int,
    runs: int,
    generate_kwargs: dict[str, Any],
    hf: tuple[nn.Module, dict[str, Any]] | None = None,
) -> tuple[tuple[float, ...], tuple[float, ...], Any, tuple[float, ...] | None]:
    """Seconds per greedy generation of exactly ``new_tokens`` tokens, the models in turn
    (after one warm-up each): the target alone, with speculation and, given ``hf`` (an HF
    model and its ``generate()`` keywords for the same speculation), HF transformers; and the
    speculative runs' summed acceptance statistics."""
    from nxdplug.plugin_api import AcceptanceStats

    total = AcceptanceStats()
    plain_times, speculative_times, hf_times = [], [], []
    with torch.inference_mode():
        _time_generate(plain, input_ids, new_tokens)
        _time_generate(speculative, input_ids, new_tokens, **generate_kwargs)
        if hf is not None:
            _time_hf_generate(hf[0], input_ids, new_tokens, **hf[1])
        for _ in range(runs):
            plain_times.append(_time_generate(plain, input_ids, new_tokens))
            speculative_times.append(
                _time_generate(speculative, input_ids, new_tokens, **generate_kwargs)
            )
            total.add(speculative.speculation_stats)
            if hf is not None:
                hf_times.append(_time_hf_generate(hf[0], input_ids, new_tokens, **hf[1]))
    hf_seconds = tuple(hf_times) if hf is not None else None
    return tuple(plain_times), tuple(speculative_times), total, hf_seconds
