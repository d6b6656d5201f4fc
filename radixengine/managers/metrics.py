"""Prometheus metrics with SGLang's names, types, labels and buckets (its
`observability/metrics_collector.py`), so dashboards written for SGLang read them unchanged.

Request-level ones are measured by the tokenizer manager (labels `model_name`, `engine_type`, as
SGLang's TokenizerMetricsCollector); the scheduler's live state (running / queued requests, token
usage, cache hit rate, gen throughput, ...) is read from `get_internal_state()` when /metrics is
scraped and carries the scheduler's labels (`model_name`, `engine_type`, `tp_rank`, `pp_rank`,
`moe_ep_rank`). Each engine has its own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "sglang:"
ENGINE_TYPE = "unified"  # SGLang's label for a server that is neither a PD prefill nor decode node

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (*TTFT_BUCKETS, 600, 1200, 1800, 2400)
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
    0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0,
)  # fmt: skip
QUEUE_TIME_BUCKETS = (
    0.0, 0.001, 0.005, 0.010, 0.050, 0.100, 0.200, 0.500, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60,
    70, 80, 90, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000,
    2500, 3000,
)  # fmt: skip
TOKENS_BUCKETS = (
    100, 300, 500, 700, 1000, 1500, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 10000, 12500,
    15000, 17500, 20000, 22500, 25000, 27500, 30000, 35000, 40000, 60000, 80000, 100000, 200000,
    300000, 400000, 600000, 800000, 1000000, 1100000,
)  # fmt: skip


def tokenizer_labels(model_name: str) -> dict[str, str]:
    return {"model_name": model_name, "engine_type": ENGINE_TYPE}


def scheduler_labels(model_name: str) -> dict[str, str]:
    return {**tokenizer_labels(model_name), "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}


class SchedulerStatsCollector:
    """Exposes the last scheduler state snapshot (set by `update`) as SGLang's scheduler gauges
    and counters. `sglang:kv_protected_tokens` and `sglang:num_preempted_requests_total` are ours
    (SGLang has no such series)."""

    GAUGES = {  # metric name: (state key, help)
        "num_running_reqs": ("num_running_reqs", "The number of running requests."),
        "num_queue_reqs": ("num_queue_reqs", "The number of requests in the waiting queue."),
        "num_grammar_queue_reqs": (
            "num_grammar_queue_reqs",
            "The number of requests waiting for their grammar to compile.",
        ),
        "gen_throughput": (
            "gen_throughput",
            "The generation throughput (token/s), over the last --decode-log-interval decode steps; 0 idle.",
        ),
        "cache_hit_rate": (
            "cache_hit_rate",
            "The prefix cache hit rate: cached / (cached + computed) prompt tokens, since start.",
        ),
        "token_usage": (
            "token_usage",
            "The token usage: KV slots in use (not free or evictable) / pool size.",
        ),
        "num_used_tokens": ("num_used_tokens", "The number of used tokens."),
        "kv_used_tokens": ("num_used_tokens", "Number of actively used token slots in the KV cache pool."),
        "kv_available_tokens": ("available_tokens", "Number of free token slots in the KV cache pool."),
        "kv_evictable_tokens": (
            "evictable_tokens",
            "Number of evictable (radix-cached) token slots in the KV cache pool.",
        ),
        "kv_protected_tokens": (
            "protected_tokens",
            "Radix-cached token slots locked by running requests (not evictable).",
        ),
        "new_token_ratio": ("new_token_ratio", "The new token ratio of the scheduler's admission estimate."),
        "spec_accept_length": (
            "avg_spec_accept_length",
            "Speculative decoding: tokens a request takes from a verify step, on average since start.",
        ),
        "max_total_num_tokens": ("max_total_tokens", "Maximum total number of tokens in the KV cache pool."),
        # The hierarchical cache (present only with its tiers).
        "hicache_host_used_tokens": ("host_pool_used_tokens", "Token slots in use in the host tier's pool."),
        "hicache_host_total_tokens": ("host_pool_size", "Token slots of the host tier's pool."),
        "hicache_storage_write_queue_pages": (
            "storage_pages_queued",
            "Pages waiting in the storage writer's queue.",
        ),
        "hicache_host_loads_in_flight": ("host_loads_in_flight", "Host-to-device copies not finished yet."),
        "hicache_storage_bytes": ("storage_bytes", "Bytes of the pages in the storage folder."),
        "hicache_storage_max_bytes": ("storage_max_bytes", "The storage folder's size bound (0: none)."),
        "hicache_storage_prefetch_bytes": (
            "storage_prefetch_bytes",
            "Bytes of pages read ahead from storage and not loaded yet.",
        ),
        "hicache_storage_prefetches_in_flight": (
            "storage_prefetches_in_flight",
            "Queued requests holding a storage prefetch.",
        ),
        "hicache_device_hit_rate": (
            "cache_hit_rate_device",
            "Prompt tokens served from the device tree / all prompt tokens, since start.",
        ),
        "hicache_host_hit_rate": (
            "cache_hit_rate_host",
            "Prompt tokens loaded from the host tier / all prompt tokens, since start.",
        ),
        "hicache_storage_hit_rate": (
            "cache_hit_rate_storage",
            "Prompt tokens loaded from storage / all prompt tokens, since start.",
        ),
    }
    COUNTERS = {
        "num_retracted_requests_total": (
            "num_retracted_reqs",
            "Requests retracted because decode ran out of KV memory.",
        ),
        "num_preempted_requests_total": ("num_preempted_reqs", "Requests preempted by higher-priority ones."),
        "hicache_host_written_tokens_total": ("host_tokens_written", "Tokens backed up to the host tier."),
        "hicache_host_loaded_tokens_total": ("host_tokens_loaded", "Tokens loaded back from the host tier."),
        "hicache_host_evicted_tokens_total": ("host_tokens_evicted", "Tokens the host tier's pool evicted."),
        "hicache_storage_written_pages_total": (
            "storage_pages_written",
            "Pages written to the storage tier.",
        ),
        "hicache_storage_read_pages_total": (
            "storage_pages_loaded",
            "Pages read from storage into the KV pool.",
        ),
        "hicache_storage_failed_writes_total": (
            "storage_write_failures",
            "Pages the storage tier failed to write.",
        ),
        "hicache_storage_dropped_pages_total": (
            "storage_pages_dropped",
            "Pages not written: the writer's queue was at its byte bound.",
        ),
        "hicache_storage_present_pages_total": (
            "storage_pages_present",
            "Pages not written because storage already had them.",
        ),
        "hicache_storage_prefetches_total": ("storage_prefetches", "Storage prefetches started."),
        "hicache_storage_prefetch_pages_total": ("storage_prefetch_pages_read", "Pages read by prefetches."),
        "hicache_storage_prefetch_misses_total": (
            "storage_prefetch_misses",
            "Prefetches that stopped at a page storage does not have.",
        ),
        "hicache_storage_prefetches_given_up_total": (
            "storage_prefetches_given_up",
            "Prefetches admission stopped waiting for (timeout, wait_complete's stall).",
        ),
        "hicache_storage_prefetches_truncated_total": (
            "storage_prefetches_truncated",
            "Prefetches cut short by the prefetch memory bound.",
        ),
    }
    # sglang:realtime_tokens_total{mode}: state key per mode.
    REALTIME_TOKENS = {
        "prefill_compute": "num_prefill_tokens",
        "prefill_cache": "num_cached_tokens",
        "decode": "num_generated_tokens",
    }

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.state: dict = {}

    def update(self, state: dict) -> None:
        self.state = dict(state)

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())
        state = _with_derived(self.state)
        for name, (key, doc) in self.GAUGES.items():
            if key in state:
                g = GaugeMetricFamily(PREFIX + name, doc, labels=names)
                g.add_metric(values, float(state[key]))
                yield g
        for name, (key, doc) in self.COUNTERS.items():
            if key in state:
                c = CounterMetricFamily(PREFIX + name, doc, labels=names)
                c.add_metric(values, float(state[key]))
                yield c
        if all(key in state for key in self.REALTIME_TOKENS.values()):
            c = CounterMetricFamily(
                PREFIX + "realtime_tokens_total",
                "Total number of tokens processed. mode: prefill_compute, prefill_cache, decode.",
                labels=[*names, "mode"],
            )
            for mode, key in self.REALTIME_TOKENS.items():
                c.add_metric([*values, mode], float(state[key]))
            yield c


def _with_derived(state: dict) -> dict:
    state = dict(state)
    total = state.get("max_total_tokens")
    if total and "available_tokens" in state:
        used = total - state["available_tokens"] - state.get("evictable_tokens", 0)
        state.setdefault("num_used_tokens", max(used, 0))
        state.setdefault("token_usage", max(used, 0) / total)
    return state


class TokenizerMetricsCollector:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = tokenizer_labels(model_name)
        self.scheduler_labels = scheduler_labels(model_name)
        self.prompt_tokens = self._counter("prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = self._counter(
            "generation_tokens_total", "Number of generation tokens processed."
        )
        self.cached_tokens = self._counter(
            "cached_tokens_total",
            "Number of cached prompt tokens by source (device/host/storage).",
            "cache_source",
        )
        self.num_requests = self._counter("num_requests_total", "Number of requests processed.")
        self.num_aborted = self._counter("num_aborted_requests_total", "Number of requests aborted.")
        self.num_aborted.labels(**self.labels)  # exported (0) before the first abort: dashboards show it
        self.scheduler_restarts = self._counter(
            "scheduler_restarts_total", "Times a dead scheduler process was started again."
        )
        self.scheduler_restarts.labels(**self.labels)
        self._init_histograms()
        self.scheduler = SchedulerStatsCollector(self.scheduler_labels)
        self.registry.register(self.scheduler)

    def _init_histograms(self) -> None:
        self.prompt_tokens_histogram = self._histogram(
            "prompt_tokens_histogram", "Histogram of prompt token length.", TOKENS_BUCKETS
        )
        self.generation_tokens_histogram = self._histogram(
            "generation_tokens_histogram", "Histogram of generation token length.", TOKENS_BUCKETS
        )
        self.ttft = self._histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", E2E_BUCKETS
        )
        self.queue_time = Histogram(
            PREFIX + "queue_time_seconds",
            "Histogram of queueing time in seconds.",
            list(self.scheduler_labels),
            buckets=QUEUE_TIME_BUCKETS,
            registry=self.registry,
        )

    def _counter(self, name: str, doc: str, *extra_labels: str) -> Counter:
        return Counter(PREFIX + name, doc, [*self.labels, *extra_labels], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple) -> Histogram:
        return Histogram(PREFIX + name, doc, list(self.labels), buckets=buckets, registry=self.registry)

    def observe_tokens(self, state, num_new: int, now: float) -> None:
        """Time to first token, and the gap per token since the previous output (ITL)."""
        if state.first_token_time is None:
            self.ttft.labels(**self.labels).observe(now - state.created_time)
            num_new -= 1
        if num_new > 0 and state.last_token_time is not None:
            per_token = (now - state.last_token_time) / num_new
            hist = self.itl.labels(**self.labels)
            for _ in range(num_new):
                hist.observe(per_token)

    def observe_finished(self, meta: dict, created: float, now: float) -> None:
        """A request the scheduler is done with. As in SGLang, an aborted one (its client left, or
        /abort_request: status 499) counts as a request too, with the tokens it got, and as aborted;
        one the scheduler refused (a 400, a full queue's 503) counts as a request, not as aborted."""
        reason = meta.get("finish_reason") or {}
        if reason.get("type") == "abort" and reason.get("status_code") == 499:
            self.num_aborted.labels(**self.labels).inc()
        prompt, generated, cached = meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]
        self.num_requests.labels(**self.labels).inc()
        self.prompt_tokens.labels(**self.labels).inc(prompt)
        self.generation_tokens.labels(**self.labels).inc(generated)
        details = meta.get("cached_tokens_details") or {}
        by_source = {"host": details.get("host", 0), "storage": details.get("storage", 0)}
        by_source["device"] = cached - by_source["host"] - by_source["storage"]
        for source, count in by_source.items():
            if count > 0:
                self.cached_tokens.labels(**self.labels, cache_source=source).inc(count)
        self.prompt_tokens_histogram.labels(**self.labels).observe(prompt)
        self.generation_tokens_histogram.labels(**self.labels).observe(generated)
        self.e2e.labels(**self.labels).observe(now - created)

    def observe_queue_time(self, seconds: float) -> None:
        self.queue_time.labels(**self.scheduler_labels).observe(seconds)

    def render(self, scheduler_state: dict | None) -> bytes:
        if scheduler_state is not None:
            self.scheduler.update(scheduler_state)
        return generate_latest(self.registry)
