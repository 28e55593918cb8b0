"""What an nxdplug server says of itself on ``/metrics`` (Prometheus text) while a benchmark
loads it: the peak of its running requests, polled on a thread since a gauge keeps no history,
and its prefix cache's hit rate over the timed load, from counters read before and after it so
that the warm-up requests do not count. A server without these metrics (transformers serve has
no ``/metrics``) gives none of these figures, and no error.
"""

from __future__ import annotations

import contextlib
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping

POLL_INTERVAL_S = 0.1
SCRAPE_TIMEOUT_S = 2.0
RUNNING = "nxdplug:num_requests_running"
PREFIX_HITS = "nxdplug:prefix_cache_hits_total"
PREFIX_QUERIES = "nxdplug:prefix_cache_queries_total"
DRAFTS = "nxdplug:spec_decode_num_drafts_total"
DRAFT_TOKENS = "nxdplug:spec_decode_num_draft_tokens_total"
ACCEPTED_TOKENS = "nxdplug:spec_decode_num_accepted_tokens_total"


def metrics_url(base_url: str) -> str:
    """``/metrics`` beside the OpenAI API: ``http://h:p/v1`` gives ``http://h:p/metrics``."""
    return base_url.rstrip("/").removesuffix("/v1") + "/metrics"


def scrape(url: str) -> dict[str, float] | None:
    """The samples of the Prometheus page at ``url`` by name (labelled samples summed); None
    when it does not answer 200."""
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
            text = response.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError):  # HTTPError is a URLError
        return None
    return parse_prometheus_text(text)


def parse_prometheus_text(text: str) -> dict[str, float]:
    """``name{labels} value [timestamp]`` lines by name, comments skipped, the values of one
    name summed over its labels."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.partition(" ")
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        samples[name.strip()] = samples.get(name.strip(), 0.0) + value
    return samples


@contextlib.contextmanager
def polled_running_requests(url: str) -> Iterator[list[float]]:
    """Read the running-requests gauge every :data:`POLL_INTERVAL_S` on a thread while the
    caller's block runs; the list yielded fills with the readings. A first page without the
    gauge stops the polling (a server that has none); a later failed scrape is skipped."""
    readings: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            value = (scrape(url) or {}).get(RUNNING)
            if value is None and not readings:
                return
            if value is not None:
                readings.append(value)
            stop.wait(POLL_INTERVAL_S)

    thread = threading.Thread(target=poll, name="metrics-poll", daemon=True)
    thread.start()
    try:
        yield readings
    finally:
        stop.set()
        thread.join()


def server_figures(
    before: Mapping[str, float], after: Mapping[str, float], running: list[float]
) -> dict[str, float]:
    """``peak_running_requests``, ``server_prefix_cache_hit_rate`` (the prefix-cache hits over
    the prompt tokens looked up between the two scrapes) and, for a speculating server,
    ``spec_acceptance_rate`` (proposed tokens kept) and ``spec_tokens_per_verification``
    (tokens a request got from a verification: those kept plus the target's own), each only
    when the server gave what it needs: a server with prefix caching off looks nothing up."""
    figures: dict[str, float] = {}
    if running:
        figures["peak_running_requests"] = max(running)

    def grown(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    if PREFIX_QUERIES in after and PREFIX_HITS in after and grown(PREFIX_QUERIES) > 0:
        figures["server_prefix_cache_hit_rate"] = grown(PREFIX_HITS) / grown(PREFIX_QUERIES)
    if grown(DRAFTS) > 0 and grown(DRAFT_TOKENS) > 0:
        figures["spec_acceptance_rate"] = grown(ACCEPTED_TOKENS) / grown(DRAFT_TOKENS)
        figures["spec_tokens_per_verification"] = 1 + grown(ACCEPTED_TOKENS) / grown(DRAFTS)
    return figures
