"""`ServerMetrics`: the Prometheus view of one server (what `/metrics` returns).

Owns a private `CollectorRegistry` per app (so two apps in one process, as in tests, never
share or clash), latency histograms observed by the server when a request finishes, and a
collector that turns the async engine's latest `EngineSnapshot` into gauges and counters at
scrape time. Must not touch the `LLMEngine`: only the immutable snapshot is read here.

Metric names follow Prometheus conventions (`_seconds`, `_total`, `_ratio`); the set mirrors
what vLLM exports: queue sizes, KV usage, prefix hit rate, token counters, TTFT / TPOT / e2e.
"""

import collections
import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .async_engine import AsyncLLMEngine
from .engine import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        labels = dict(labelnames=["model_name"], registry=self.registry)
        self.ttft = Histogram("qkiln_time_to_first_token_seconds", "Time from arrival to the first output token.",
                              buckets=_LATENCY_BUCKETS, **labels).labels(model_name)
        self.tpot = Histogram("qkiln_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request.",
                              buckets=_TPOT_BUCKETS, **labels).labels(model_name)
        self.e2e = Histogram("qkiln_e2e_request_latency_seconds", "Time from arrival to the last output token.",
                             buckets=_LATENCY_BUCKETS, **labels).labels(model_name)
        self._finished = Counter("qkiln_request_success", "Engine requests (a choice is one) that finished, by "
                                 "finish reason.",
                                 labelnames=["model_name", "finish_reason"], registry=self.registry)
        self.refused_busy = Counter("qkiln_request_refused_busy", "Requests answered 429: the server was at its "
                                    "limit of requests in flight.", **labels).labels(model_name)
        self.refused_invalid = Counter("qkiln_request_refused_invalid", "HTTP requests answered 400: a malformed "
                                       "body or a value out of range.", **labels).labels(model_name)
        self._model_name = model_name
        if engine.artifact:  # qkiln_artifact_info{model_name, name, digest, serving_digest} 1: the build served
            Info("qkiln_artifact", "The artifact served: its manifest's name, digest and serving digest.", **labels) \
                .labels(model_name).info(dict(engine.artifact))
        self.registry.register(_EngineCollector(engine, model_name))

    def observe_finished(self, output: RequestOutput) -> None:
        """Record the latencies of a request that ran to completion (stop or length)."""
        m = output.metrics
        if not m:
            return
        self.ttft.observe(m["ttft"])
        self.e2e.observe(m["e2e"])
        if m["num_output_tokens"] > 1:
            self.tpot.observe((m["e2e"] - m["ttft"]) / (m["num_output_tokens"] - 1))
        self._finished.labels(self._model_name, output.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


# The tokens/s gauge's window: from the newest scrape at least this old (the engine's start while
# there is none). The rate since the previous scrape depended on who scraped last: two scrapers
# (an HA Prometheus pair, a dashboard beside it) reset each other's window (237, 71, 828 tok/s
# read 50 ms apart under a steady load).
RATE_WINDOW_S = 10.0


class _EngineCollector:
    """Reads the engine snapshot when scraped; tokens/s over the last RATE_WINDOW_S or more."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self._lock = threading.Lock()  # scrapes may run concurrently in the server's threadpool
        self._samples = collections.deque([(time.monotonic(), engine.snapshot.num_generated_tokens)])

    def _rate(self, tokens: int) -> float:
        with self._lock:
            now = time.monotonic()
            while len(self._samples) > 1 and now - self._samples[1][0] >= RATE_WINDOW_S:
                self._samples.popleft()  # the newest one at least a window old stays the base
            base_time, base_tokens = self._samples[0]
            self._samples.append((now, tokens))
            return (tokens - base_tokens) / max(now - base_time, 1e-9)

    def describe(self):
        return []  # nothing to pre-check at registration; collect() reads a live snapshot

    def collect(self):
        snap = self.engine.snapshot
        rate = self._rate(snap.num_generated_tokens)
        gauges = (
            ("qkiln_num_requests_waiting", "Requests queued, not yet scheduled (incl. preempted).", snap.num_waiting),
            ("qkiln_num_requests_running", "Requests holding KV blocks and stepping.", snap.num_running),
            ("qkiln_kv_cache_usage_ratio", "Fraction of KV blocks referenced by running requests.", snap.kv_usage),
            ("qkiln_kv_cache_free_blocks", "KV blocks free or evictable (prefix-cached, unreferenced).",
             snap.num_free_blocks),
            ("qkiln_kv_cache_blocks", "KV blocks in the pool.", snap.num_blocks),
            ("qkiln_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up.",
             snap.prefix_cache_hit_rate),
            ("qkiln_generation_tokens_per_second", f"Output tokens per second over the last {RATE_WINDOW_S:g} s "
             "or a little more (any scraper's; for alerts, rate() of qkiln_generation_tokens_total).", rate),
        )
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            yield g
        counters = (
            ("qkiln_prompt_tokens", "Prompt tokens admitted, per engine request (n choices count a prompt n "
             "times).", snap.num_prompt_tokens),
            ("qkiln_generation_tokens", "Output tokens generated.", snap.num_generated_tokens),
            ("qkiln_engine_step_errors", "Engine steps that raised (their requests were aborted).",
             snap.num_step_errors),
            ("qkiln_request_aborted", "Engine requests (a choice is one) ended before they finished: the client "
             "went away, a sibling choice was refused, or a step failed.", snap.num_aborted),
            ("qkiln_num_preemptions", "Running requests sent back to wait for KV blocks (their KV is computed "
             "again): the pool is too small for the load.", snap.num_preemptions),
        )
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c
