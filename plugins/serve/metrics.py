"""The server's Prometheus metrics, named as vLLM names its own (``vllm:num_requests_running``
becomes ``nxdplug:num_requests_running``), in a registry of their own so that two servers in
one process, or a test, never share counters."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from nxdplug.plugin_api import Engine, RequestOutput, SpeculationMetrics

# Seconds: from one CPU step of a tiny model to a long prompt's encoding on a large one.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class ServingMetrics:
    """Gauges read from the engine when scraped; counters and histograms fed per output."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        gauges = {
            "num_requests_running": ("requests on a KV-cache line", lambda: engine.num_running),
            "num_requests_waiting": ("requests waiting for a line", lambda: engine.num_waiting),
            "kv_cache_lines_in_use": ("KV-cache lines in use", lambda: engine.lines.in_use),
            "kv_cache_lines_total": ("KV-cache lines (max_batch_size)", lambda: engine.lines.count),
        }
        for name, (description, read) in gauges.items():
            Gauge(f"nxdplug:{name}", description, registry=self.registry).set_function(read)
        self.registry.register(CacheCollector(engine))
        if engine.speculation is not None:
            self.registry.register(SpeculationCollector(engine.speculation.metrics))
        self.prompt_tokens = Counter(
            "nxdplug:prompt_tokens", "prompt tokens encoded", registry=self.registry
        )
        self.generation_tokens = Counter(
            "nxdplug:generation_tokens", "tokens generated", registry=self.registry
        )
        self.request_success = Counter(
            "nxdplug:request_success",
            "requests finished, by finish reason (stop, length, abort)",
            ["finished_reason"],
            registry=self.registry,
        )
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds", "from arrival to the first token"
        )
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds", "between two tokens of a request"
        )
        self.e2e_request_latency = self._histogram(
            "e2e_request_latency_seconds", "from arrival to the last output"
        )

    def _histogram(self, name: str, description: str) -> Histogram:
        return Histogram(
            f"nxdplug:{name}", description, buckets=LATENCY_BUCKETS, registry=self.registry
        )

    def record(
        self, output: RequestOutput, arrival: float, last_token: float | None, now: float
    ) -> None:
        """Count one output of a request that arrived at ``arrival`` and whose previous token
        came at ``last_token`` (None before its first), all ``time.monotonic()`` seconds."""
        new = len(output.token_ids)
        if new and last_token is None:
            self.prompt_tokens.inc(output.prompt_tokens)
            self.time_to_first_token.observe(now - arrival)
        elif new:
            self.inter_token_latency.observe((now - last_token) / new)
        self.generation_tokens.inc(new)
        if output.finished:
            self.request_success.labels(output.finish_reason).inc()
            self.e2e_request_latency.observe(now - arrival)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class CacheCollector(Collector):
    """The KV cache's use, read from the engine when scraped, under vLLM's names: the share of
    the cache in use, the prompt tokens looked up in the prefix cache and found there, and the
    requests preempted for room."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        usage = self.engine.lines.usage()
        yield GaugeMetricFamily(
            "nxdplug:kv_cache_usage_perc", "KV-cache usage (1: full)", value=usage.used
        )
        counters = {
            "prefix_cache_queries": (
                "prompt tokens looked up in the prefix cache",
                usage.prefix_queries,
            ),
            "prefix_cache_hits": ("prompt tokens found in the prefix cache", usage.prefix_hits),
            "num_preemptions": (
                "requests preempted for KV-cache room",
                self.engine.num_preemptions,
            ),
        }
        for name, (description, value) in counters.items():
            yield CounterMetricFamily(f"nxdplug:{name}", description, value=value)


class SpeculationCollector(Collector):
    """Speculative decoding's counters under vLLM's names: the request steps that proposed
    tokens, the tokens proposed and kept, and how often the proposal at each position was
    kept."""

    def __init__(self, metrics: SpeculationMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[CounterMetricFamily]:
        counters = {
            "num_drafts": ("request steps that proposed tokens", self.metrics.drafts),
            "num_draft_tokens": ("tokens proposed", self.metrics.draft_tokens),
            "num_accepted_tokens": ("proposed tokens kept", self.metrics.accepted_tokens),
        }
        for name, (description, value) in counters.items():
            yield CounterMetricFamily(f"nxdplug:spec_decode_{name}", description, value=value)
        per_position = CounterMetricFamily(
            "nxdplug:spec_decode_num_accepted_tokens_per_pos",
            "proposed tokens kept, by position",
            labels=["position"],
        )
        for position, count in enumerate(self.metrics.accepted_per_position):
            per_position.add_metric([str(position)], count)
        yield per_position
