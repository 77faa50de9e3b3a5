"""`ServerMetrics`: the Prometheus view of one server (what `/metrics` returns).

Owns a private `CollectorRegistry` per app (so two apps in one process, as in tests, never
share or clash), latency histograms observed by the server when a request finishes, and a
collector that turns the async engine's latest `EngineSnapshot` into gauges and counters at
scrape time. Must not touch the `LLMEngine`: only the immutable snapshot is read here.

What vLLM also measures carries vLLM's name, label (`model_name`) and meaning, so dashboards and
alerts built for vLLM work unchanged: queue sizes, KV usage, token and prefix-cache counters,
preemptions, successes by `finished_reason`, and per request TTFT, e2e, queue / prefill / decode /
inference time, time per output token and prompt / output lengths (TTFT and e2e timed from the
request's arrival at the server, queue time from the engine's receipt, as vLLM's), and each gap
between a request's successive output tokens (inter-token latency). What only qkiln has is
`qkiln_*`: the artifact served, refusals, aborts, failed steps, the KV pool in blocks, a tokens/s
gauge.
"""

import collections
import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .async_engine import AsyncLLMEngine
from .engine import RequestOutput

# vLLM's buckets, with finer ones in front for a CPU host's short requests and fast tokens; the
# request buckets reach 2 hours, so a long generation is not just "+Inf"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TIMES = (  # RequestOutput.metrics key, vLLM's histogram, help
    ("queue", "vllm:request_queue_time_seconds", "Time from the engine's receipt to the request's first step."),
    ("prefill", "vllm:request_prefill_time_seconds", "Time from the first step to the first output token."),
    ("decode", "vllm:request_decode_time_seconds", "Time from the first output token to the last."),
    ("inference", "vllm:request_inference_time_seconds", "Time from the first step to the last output token."),
)


def _length_buckets(max_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's build_1_2_5_buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_len:
                return tuple(buckets)
            buckets.append(m * scale)
        scale *= 10


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        labels = dict(labelnames=["model_name"], registry=self.registry)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, buckets=buckets, **labels).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first output token.",
                              _TTFT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last output token.",
                             _REQUEST_BUCKETS)
        self.times = {key: histogram(name, doc, _REQUEST_BUCKETS) for key, name, doc in _TIMES}
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request.", _TPOT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between a request's successive output tokens.",
                             _TPOT_BUCKETS)
        lengths = _length_buckets(engine.max_model_len)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens of each finished request.",
                                       lengths)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Output tokens of each finished "
                                           "request.", lengths)
        self._finished = Counter("vllm:request_success", "Engine requests (a choice is one) that finished, by "
                                 "finish reason (aborted ones: qkiln_request_aborted_total).",
                                 labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.refused_busy = Counter("qkiln_request_refused_busy", "Requests answered 429: the server was at its "
                                    "limit of requests in flight.", **labels).labels(model_name)
        self.refused_invalid = Counter("qkiln_request_refused_invalid", "HTTP requests answered 400: a malformed "
                                       "body or a value out of range.", **labels).labels(model_name)
        self._model_name = model_name
        if engine.artifact:  # qkiln_artifact_info{model_name, name, digest, serving_digest} 1: the build served
            Info("qkiln_artifact", "The artifact served: its manifest's name, digest and serving digest.", **labels) \
                .labels(model_name).info(dict(engine.artifact))
        self.registry.register(_EngineCollector(engine, model_name))

    def observe(self, output: RequestOutput) -> None:
        """Record what an engine output carries: TTFT with a request's first token (as vLLM, so a
        request whose client leaves later counts too), the rest once it ran to its end (stop or
        length; an aborted one's last output has no metrics), and the gaps before its new tokens."""
        for gap in output.inter_token_latencies:
            self.itl.observe(gap)
        m = output.metrics
        if not m:
            return
        # the output that carries the first token (the last too, for one token; merged with later
        # ones for a stream consumer that fell behind: async_engine.MERGE_BACKLOG)
        if output.token_ids and len(output.token_ids) == len(output.new_token_ids):
            self.ttft.observe(m["ttft"])
        if not output.finished:
            return
        self.e2e.observe(m["e2e"])
        for key, histogram in self.times.items():
            histogram.observe(m[key])
        if m["num_output_tokens"] > 1:
            self.tpot.observe(m["decode"] / (m["num_output_tokens"] - 1))
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        self.generation_tokens.observe(m["num_output_tokens"])
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
            ("vllm:num_requests_waiting", "Requests waiting for a step: queued (preempted ones too), or received and "
             "not yet handed to the engine.", snap.num_waiting),
            ("vllm:num_requests_running", "Requests holding KV blocks and stepping.", snap.num_running),
            ("vllm:kv_cache_usage_perc", "Fraction of KV blocks referenced by requests (1 = all).", snap.kv_usage),
            ("qkiln_kv_cache_free_blocks", "KV blocks free or evictable (prefix-cached, unreferenced).",
             snap.num_free_blocks),
            ("qkiln_kv_cache_blocks", "KV blocks in the pool.", snap.num_blocks),
            ("qkiln_generation_tokens_per_second", f"Output tokens per second over the last {RATE_WINDOW_S:g} s "
             "or a little more (any scraper's; for alerts, rate() of vllm:generation_tokens_total).", rate),
        )
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            yield g
        counters = (
            ("vllm:prompt_tokens", "Prompt tokens admitted, per engine request (n choices count a prompt n "
             "times).", snap.num_prompt_tokens),
            ("vllm:generation_tokens", "Output tokens generated.", snap.num_generated_tokens),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", snap.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (rate() over rate() of "
             "queries: the hit rate).", snap.prefix_cache_hits),
            ("vllm:num_preemptions", "Running requests sent back to wait for KV blocks (their KV is computed "
             "again): the pool is too small for the load.", snap.num_preemptions),
            ("qkiln_engine_step_errors", "Engine steps that raised (their requests were aborted).",
             snap.num_step_errors),
            ("qkiln_request_aborted", "Engine requests (a choice is one) ended before they finished: the client "
             "went away, a sibling choice was refused, or a step failed.", snap.num_aborted),
        )
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c
