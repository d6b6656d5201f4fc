"""Prometheus metrics: request-level ones measured by the tokenizer manager, and the scheduler's
live state (running / queued requests, token usage, cache hit rate, retractions, preemptions),
read from `get_internal_state()` when /metrics is scraped. Each engine has its own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "radixengine:"
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip


class SchedulerStatsCollector:
    """Exposes the last scheduler state snapshot (set by `update`) as gauges and counters."""

    GAUGES = {
        "num_running_reqs": "Requests in the running batch",
        "num_queue_reqs": "Requests waiting in the queue",
        "token_usage": "Fraction of the KV pool in use by running requests",
        "cache_hit_rate": "Cached prompt tokens / prompt tokens, since start",
        "max_total_tokens": "KV pool size in tokens",
        "available_tokens": "Free KV slots",
        "evictable_tokens": "KV slots held by the radix cache, evictable",
        "protected_tokens": "KV slots held by the radix cache, locked by running requests",
    }
    COUNTERS = {
        "num_retracted_reqs": "Requests retracted because decode ran out of KV memory",
        "num_preempted_reqs": "Requests preempted by higher-priority ones",
        "num_prefill_tokens": "Prompt tokens computed by prefill",
        "num_cached_tokens": "Prompt tokens served from the radix cache",
    }

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.state: dict = {}

    def update(self, state: dict) -> None:
        self.state = dict(state)

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())
        state = _with_derived(self.state)
        for key, doc in self.GAUGES.items():
            if key in state:
                g = GaugeMetricFamily(PREFIX + key, doc, labels=names)
                g.add_metric(values, float(state[key]))
                yield g
        for key, doc in self.COUNTERS.items():
            if key in state:
                c = CounterMetricFamily(PREFIX + key, doc, labels=names)
                c.add_metric(values, float(state[key]))
                yield c


def _with_derived(state: dict) -> dict:
    state = dict(state)
    total = state.get("max_total_tokens")
    if "token_usage" not in state and total:
        used = total - state.get("available_tokens", total) - state.get("evictable_tokens", 0)
        state["token_usage"] = max(used, 0) / total
    if "cache_hit_rate" not in state and "num_cached_tokens" in state:
        computed = state.get("num_prefill_tokens", 0)
        cached = state["num_cached_tokens"]
        state["cache_hit_rate"] = cached / (cached + computed) if cached + computed else 0.0
    for key in ("num_running_reqs", "num_queue_reqs"):
        alt = {"num_running_reqs": "num_running", "num_queue_reqs": "num_waiting"}[key]
        if key not in state and alt in state:
            state[key] = state[alt]
    return state


class TokenizerMetricsCollector:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.labels = labels
        names = list(labels)
        r = self.registry
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests", names, registry=r
        )
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens", names, registry=r)
        self.cached_tokens = Counter(
            PREFIX + "cached_tokens", "Prompt tokens served from cache", names, registry=r
        )
        self.num_requests = Counter(PREFIX + "num_requests", "Finished requests", names, registry=r)
        self.num_aborted = Counter(
            PREFIX + "num_aborted_requests", "Aborted or rejected requests", names, registry=r
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token",
            names,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between tokens",
            names,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "End-to-end latency",
            names,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            PREFIX + "queue_time_seconds",
            "Time a request waited in the scheduler's queue, by priority",
            names + ["priority"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.scheduler = SchedulerStatsCollector(labels)
        r.register(self.scheduler)

    def observe_tokens(self, state, num_new: int, now: float) -> None:
        self.generation_tokens.labels(**self.labels).inc(num_new)
        if state.first_token_time is None:
            self.ttft.labels(**self.labels).observe(now - state.created_time)
            num_new -= 1
        if num_new > 0 and state.last_token_time is not None:
            per_token = (now - state.last_token_time) / num_new
            hist = self.itl.labels(**self.labels)
            for _ in range(num_new):
                hist.observe(per_token)

    def observe_finished(
        self, meta: dict, first_token_time: float | None, created: float, now: float
    ) -> None:
        reason = meta.get("finish_reason") or {}
        if reason.get("type") == "abort":
            self.num_aborted.labels(**self.labels).inc()
            return
        self.num_requests.labels(**self.labels).inc()
        self.prompt_tokens.labels(**self.labels).inc(meta["prompt_tokens"])
        self.cached_tokens.labels(**self.labels).inc(meta["cached_tokens"])
        self.e2e.labels(**self.labels).observe(now - created)

    def observe_queue_time(self, priority: int | None, seconds: float) -> None:
        self.queue_time.labels(**self.labels, priority=str(priority)).observe(seconds)

    def render(self, scheduler_state: dict | None) -> bytes:
        if scheduler_state is not None:
            self.scheduler.update(scheduler_state)
        return generate_latest(self.registry)
