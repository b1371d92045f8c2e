"""Prometheus metrics, named as vLLM names them (with our prefix) so existing
dashboards need only the prefix changed.

Per-request histograms and token counters are fed on the engine loop thread
(prometheus_client is thread-safe); engine gauges are read at scrape time
from the engine's stats() that the loop publishes after every iteration. The registry is
our own, never the process-global default one.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

PREFIX = "pagedserve:"

# Bucket edges in seconds, spanning a GPU's milliseconds to a CPU's tens of seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0)
LATENCY_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0)
STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


# The engine gauges and counters read from stats(): (name, help, stats key, is a counter).
_ENGINE_METRICS = (
    ("num_requests_running", "Sequences in the running batch.", "num_running", False),
    ("num_requests_waiting", "Sequences waiting to be scheduled.", "num_waiting", False),
    ("kv_cache_usage_perc", "Fraction of KV blocks held by requests (1 = full).", "pool_utilization", False),
    ("prefix_cache_hit_rate", "Prefix-cache hits over queried blocks, since start.", "prefix_hit_rate", False),
    ("num_kv_blocks", "KV cache blocks in the pool.", "num_blocks", False),
    ("num_free_kv_blocks", "KV blocks allocatable now (free plus cached-evictable).", "num_free_blocks", False),
    ("num_cached_kv_blocks", "KV blocks held by nobody but kept for prefix reuse.", "num_evictable_blocks", False),
    ("num_preemptions", "Sequences preempted to free KV blocks.", "num_preemptions", True),
    ("prefix_cache_queried_blocks", "Whole prompt blocks looked up in the prefix cache.", "prefix_queried_blocks",
     True),
    ("prefix_cache_hit_blocks", "Whole prompt blocks found in the prefix cache.", "prefix_hit_blocks", True),
)


class _EngineGauges:
    """Collector reading the loop's latest published stats at scrape time. With data-parallel
    replicas (stats carry "replicas") each metric has one sample per replica, labelled replica="i",
    so sum() over them is the server's total."""

    def __init__(self, model_name: str, read_stats: Callable[[], Optional[dict]]):
        self._model_name = model_name
        self._read_stats = read_stats

    def collect(self) -> Iterable:
        s = self._read_stats()
        if not s:
            return
        replicas = s.get("replicas")
        rows = [([self._model_name], s)] if not replicas else \
            [([self._model_name, str(r["replica"])], r) for r in replicas]
        labels = ["model_name"] + (["replica"] if replicas else [])
        for name, doc, key, is_counter in _ENGINE_METRICS:
            family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(PREFIX + name, doc, labels=labels)
            for values, stats in rows:
                family.add_metric(values, stats.get(key, 0))
            yield family


class _RequestTally:
    """Output tokens and finish reasons of one request's samples, as its deltas pass."""

    def __init__(self) -> None:
        self.lengths: dict[int, int] = {}
        self.reasons: dict[int, str] = {}

    def add(self, c) -> None:
        self.lengths[c.index] = self.lengths.get(c.index, 0) + len(c.token_ids)
        if c.finish_reason:
            self.reasons[c.index] = c.finish_reason

    def finish_reason(self) -> str:
        distinct = set(self.reasons.values())
        return distinct.pop() if len(distinct) == 1 else "mixed"


class ServerMetrics:
    """All server metrics. Implements the engine loop's StepObserver."""

    def __init__(self, model_name: str, read_stats: Callable[[], Optional[dict]]):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry
        self.time_to_first_token = Histogram(PREFIX + "time_to_first_token_seconds",
                                             "Arrival to first generated token.", labels, registry=reg,
                                             buckets=TTFT_BUCKETS).labels(model_name)
        self.time_per_output_token = Histogram(PREFIX + "time_per_output_token_seconds",
                                               "Mean time between output tokens of a request, after the first.",
                                               labels, registry=reg, buckets=TPOT_BUCKETS).labels(model_name)
        self.e2e_request_latency = Histogram(PREFIX + "e2e_request_latency_seconds",
                                             "Arrival to finish.", labels, registry=reg,
                                             buckets=LATENCY_BUCKETS).labels(model_name)
        self.step_duration = Histogram(PREFIX + "engine_step_duration_seconds", "One engine.step().", labels,
                                       registry=reg, buckets=STEP_BUCKETS).labels(model_name)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of accepted requests.", labels,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", labels,
                                         registry=reg).labels(model_name)
        self._request_success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                        labels + ["finished_reason"], registry=reg)
        self._rejected = Counter(PREFIX + "num_requests_rejected",
                                 "Requests refused at submission (queue full, not serving, refused by the engine).",
                                 labels + ["reason"], registry=reg)
        reg.register(_EngineGauges(model_name, read_stats))
        self._in_flight: dict[str, _RequestTally] = {}  # loop thread only

    # ------------------------------------------------------------------ StepObserver (loop thread)
    def on_request_added(self, request_id: str, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self._in_flight[request_id] = _RequestTally()

    def on_outputs(self, outputs: list) -> None:
        new_tokens = 0
        for out in outputs:
            tally = self._in_flight.get(out.request_id)
            for c in out.outputs:
                new_tokens += len(c.token_ids)
                if tally is not None:
                    tally.add(c)
            if out.finished:
                self._observe_finished(out, self._in_flight.pop(out.request_id, None) or _RequestTally())
        if new_tokens:
            self.generation_tokens.inc(new_tokens)

    def on_step(self, step_seconds: float, stats: dict) -> None:
        # Replicas in processes of their own report their steps' durations; the loop's step() only
        # collected their outputs then.
        for seconds in stats.get("replica_step_seconds", (step_seconds,)):
            self.step_duration.observe(seconds)

    def on_requests_dropped(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._in_flight.pop(rid, None)

    def _observe_finished(self, out, tally: "_RequestTally") -> None:
        reason = tally.finish_reason()
        self._request_success.labels(self.model_name, reason).inc()
        if reason == "abort":
            return  # cut short: its latencies describe the client, not the server
        m = out.metrics
        if m.first_token_time is not None:
            self.time_to_first_token.observe(max(m.first_token_time - m.arrival_time, 0.0))
        if m.finished_time is not None:
            self.e2e_request_latency.observe(max(m.finished_time - m.arrival_time, 0.0))
        longest = max(tally.lengths.values(), default=0)
        if longest > 1 and m.first_token_time is not None and m.last_token_time is not None:
            self.time_per_output_token.observe((m.last_token_time - m.first_token_time) / (longest - 1))

    # ------------------------------------------------------------------ other events (event loop thread)
    def on_rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
