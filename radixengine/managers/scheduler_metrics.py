"""The scheduler's counters, its log lines (SGLang's wording and fields) and its state snapshot
(`get_internal_state`, read by /metrics, /v1/loads and the tests)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixengine.managers.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from radixengine.managers.scheduler import Scheduler

logger = logging.getLogger("radixengine.managers.scheduler")


@dataclass
class SchedulerStats:
    num_prefill_tokens: int = 0  # prompt tokens computed (KV written by a prefill)
    num_cached_tokens: int = 0  # prompt tokens served from the cache
    num_generated_tokens: int = 0
    num_retracted_reqs: int = 0
    num_preempted_reqs: int = 0
    num_forward_steps: int = 0

    @property
    def cache_hit_rate(self) -> float:
        total = self.num_prefill_tokens + self.num_cached_tokens
        return self.num_cached_tokens / total if total else 0.0


class SchedulerMetricsMixin:
    def init_metrics(self: Scheduler) -> None:
        self.stats = SchedulerStats()
        self.forward_ct_decode = 0
        self.last_prefill_stats_tic = self.last_decode_stats_tic = time.perf_counter()
        self.generated_at_last_decode_log = 0
        self.last_gen_throughput = 0.0

    def _token_usage(self: Scheduler) -> tuple[int, float]:
        """KV slots in use (neither free nor evictable cache) and their share of the pool."""
        free = self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size()
        used = self.max_total_num_tokens - free
        return used, used / self.max_total_num_tokens

    def _graph_label(self: Scheduler, batch: ScheduleBatch | None) -> str:
        """SGLang's `cuda graph: <bool>` field: whether the model runner replays a graph for it."""
        runner = getattr(self.tp_worker, "model_runner", None)
        graph = getattr(runner, "cuda_graph_runner", None)
        can_run = (
            graph is not None
            and batch is not None
            and batch.forward_mode.is_decode()
            and 0 < batch.batch_size() <= graph.max_bs
        )
        return f"{'cpu' if self.device.type == 'cpu' else 'cuda'} graph: {can_run}"

    def log_prefill_stats(self: Scheduler, num_new_seqs: int, new_tokens: int, cached_tokens: int) -> None:
        """Every prefill batch; its input throughput is its new tokens over the time since the
        previous prefill batch."""
        if not logger.isEnabledFor(logging.INFO):
            return
        now = time.perf_counter()
        gap, self.last_prefill_stats_tic = now - self.last_prefill_stats_tic, now
        _, usage = self._token_usage()
        logger.info(
            "Prefill batch, #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d, #pending-token: %d, %s, input throughput (token/s): %.2f",
            num_new_seqs,
            new_tokens,
            cached_tokens,
            usage,
            len(self.running_batch.reqs),
            len(self.waiting_queue),
            sum(len(r.origin_input_ids) + len(r.output_ids) for r in self.waiting_queue),
            self._graph_label(None),
            new_tokens / gap if gap > 0 else 0.0,
        )

    def log_decode_stats(self: Scheduler, batch: ScheduleBatch) -> None:
        """Every `--decode-log-interval` decode steps: the line, and `gen_throughput` (the tokens
        sampled since the previous line over the time since it)."""
        self.forward_ct_decode += 1
        if self.forward_ct_decode % self.decode_log_interval:
            return
        now = time.perf_counter()
        generated = self.stats.num_generated_tokens - self.generated_at_last_decode_log
        gap = now - self.last_decode_stats_tic
        self.last_gen_throughput = generated / gap if gap > 0 else 0.0
        self.last_decode_stats_tic, self.generated_at_last_decode_log = now, self.stats.num_generated_tokens
        if not logger.isEnabledFor(logging.INFO):
            return
        used, usage = self._token_usage()
        logger.info(
            "Decode batch, #running-req: %d, #token: %d, token usage: %.2f, %s, "
            "gen throughput (token/s): %.2f, #queue-req: %d",
            batch.batch_size(),
            used,
            usage,
            self._graph_label(batch),
            self.last_gen_throughput,
            len(self.waiting_queue),
        )

    def _reset_decode_stats(self: Scheduler) -> None:
        """Idle: nothing is generated (SGLang reports gen_throughput 0), and the next interval
        starts when work does."""
        self.last_gen_throughput = 0.0
        self.forward_ct_decode = 0
        self.last_decode_stats_tic = time.perf_counter()
        self.generated_at_last_decode_log = self.stats.num_generated_tokens

    def get_internal_state(self: Scheduler) -> dict:
        available = self.token_to_kv_pool_allocator.available_size()
        evictable = self.tree_cache.evictable_size()
        s = self.stats
        return {
            "num_running_reqs": len({id(r) for r in self._active_reqs() if not r.finished()}),
            "num_queue_reqs": len(self.waiting_queue),
            "num_grammar_queue_reqs": len(self.grammar_manager),
            "num_queue_tokens": sum(r.seqlen for r in self.waiting_queue),  # /v1/loads
            "num_retracted_reqs": s.num_retracted_reqs,
            "num_preempted_reqs": s.num_preempted_reqs,
            "num_prefill_tokens": s.num_prefill_tokens,
            "num_cached_tokens": s.num_cached_tokens,
            "num_generated_tokens": s.num_generated_tokens,
            "num_forward_steps": s.num_forward_steps,
            "num_shared_prefix_forwards": self.tp_worker.num_shared_prefix_forwards(),
            "max_total_tokens": self.max_total_num_tokens,
            "available_tokens": available,
            "evictable_tokens": evictable,
            "protected_tokens": self.tree_cache.protected_size(),
            "token_usage": 1.0 - (available + evictable) / self.max_total_num_tokens,
            "cache_hit_rate": s.cache_hit_rate,
            "new_token_ratio": self.new_token_ratio,
            "gen_throughput": self.last_gen_throughput,
        }
