"""The metrics reporter: the Prefill / Decode log lines (SGLang's wording and fields), the decode
throughput they report, and the scheduler's state snapshot (`get_internal_state`, read by
/metrics, /v1/loads and the tests)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from radixengine.managers.schedule_batch import Req, ScheduleBatch
from radixengine.managers.scheduler_components.scheduler_stats import SchedulerStats
from radixengine.mem_cache.allocator import BaseTokenToKVPoolAllocator
from radixengine.mem_cache.base_prefix_cache import BasePrefixCache

logger = logging.getLogger("radixengine.managers.scheduler")


class GraphRunner(Protocol):
    max_bs: int


@dataclass(frozen=True)
class MemoryView:
    """The pools whose usage the log lines and the state report."""

    allocator: BaseTokenToKVPoolAllocator
    tree_cache: BasePrefixCache
    max_total_num_tokens: int

    def token_usage(self) -> tuple[int, float]:
        """KV slots in use (neither free nor evictable cache) and their share of the pool."""
        free = self.allocator.available_size() + self.tree_cache.evictable_size()
        used = self.max_total_num_tokens - free
        return used, used / self.max_total_num_tokens


@dataclass(frozen=True)
class QueueView:
    """What the log lines and the state say of the requests (read at the call)."""

    running: list[Req]
    waiting: list[Req]


class MetricsReporter:
    def __init__(
        self,
        stats: SchedulerStats,
        memory: MemoryView,
        device: torch.device,
        graph_runner: GraphRunner | None,
        decode_log_interval: int,
    ) -> None:
        self.stats = stats
        self.memory = memory
        self.device = device
        self.graph_runner = graph_runner
        self.decode_log_interval = decode_log_interval
        self.forward_ct_decode = 0
        self.last_prefill_stats_tic = self.last_decode_stats_tic = time.perf_counter()
        self.generated_at_last_decode_log = 0
        self.last_gen_throughput = 0.0

    def _graph_label(self, batch: ScheduleBatch | None) -> str:
        """SGLang's `cuda graph: <bool>` field: whether the model runner replays a graph for it."""
        graph = self.graph_runner
        can_run = (
            graph is not None
            and batch is not None
            and batch.forward_mode.is_decode()
            and 0 < batch.batch_size() <= graph.max_bs
        )
        return f"{'cpu' if self.device.type == 'cpu' else 'cuda'} graph: {can_run}"

    def log_prefill_stats(
        self, num_new_seqs: int, new_tokens: int, cached_tokens: int, queues: QueueView
    ) -> None:
        """Every prefill batch; its input throughput is its new tokens over the time since the
        previous prefill batch."""
        if not logger.isEnabledFor(logging.INFO):
            return
        now = time.perf_counter()
        gap, self.last_prefill_stats_tic = now - self.last_prefill_stats_tic, now
        _, usage = self.memory.token_usage()
        logger.info(
            "Prefill batch, #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d, #pending-token: %d, %s, input throughput (token/s): %.2f",
            num_new_seqs,
            new_tokens,
            cached_tokens,
            usage,
            len(queues.running),
            len(queues.waiting),
            sum(len(r.origin_input_ids) + len(r.output_ids) for r in queues.waiting),
            self._graph_label(None),
            new_tokens / gap if gap > 0 else 0.0,
        )

    def log_decode_stats(self, batch: ScheduleBatch, num_waiting: int) -> None:
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
        used, usage = self.memory.token_usage()
        accept = (
            f"accept len: {self.stats.avg_spec_accept_length:.2f}, "
            if self.stats.num_spec_verify_reqs
            else ""
        )
        logger.info(
            "Decode batch, #running-req: %d, #token: %d, token usage: %.2f, %s%s, "
            "gen throughput (token/s): %.2f, #queue-req: %d",
            batch.batch_size(),
            used,
            usage,
            accept,
            self._graph_label(batch),
            self.last_gen_throughput,
            num_waiting,
        )

    def reset_decode_stats(self) -> None:
        """Idle: nothing is generated (SGLang reports gen_throughput 0), and the next interval
        starts when work does."""
        self.last_gen_throughput = 0.0
        self.forward_ct_decode = 0
        self.last_decode_stats_tic = time.perf_counter()
        self.generated_at_last_decode_log = self.stats.num_generated_tokens

    def internal_state(
        self,
        queues: QueueView,
        num_grammar_queue_reqs: int,
        new_token_ratio: float,
        num_shared_prefix_forwards: int,
    ) -> dict:
        m = self.memory
        available, evictable = m.allocator.available_size(), m.tree_cache.evictable_size()
        tiers = m.tree_cache.tier_stats()
        s = self.stats
        return {
            "num_running_reqs": len({id(r) for r in queues.running if not r.finished()}),
            "num_queue_reqs": len(queues.waiting),
            "num_grammar_queue_reqs": num_grammar_queue_reqs,
            "num_queue_tokens": sum(r.seqlen for r in queues.waiting),  # /v1/loads
            "num_retracted_reqs": s.num_retracted_reqs,
            "num_preempted_reqs": s.num_preempted_reqs,
            "num_prefill_tokens": s.num_prefill_tokens,
            "num_cached_tokens": s.num_cached_tokens,
            "num_generated_tokens": s.num_generated_tokens,
            "num_forward_steps": s.num_forward_steps,
            "num_shared_prefix_forwards": num_shared_prefix_forwards,
            "max_total_tokens": m.max_total_num_tokens,
            "available_tokens": available,
            "evictable_tokens": evictable,
            "protected_tokens": m.tree_cache.protected_size(),
            "token_usage": 1.0 - (available + evictable) / m.max_total_num_tokens,
            "cache_hit_rate": s.cache_hit_rate,
            "new_token_ratio": new_token_ratio,
            "gen_throughput": self.last_gen_throughput,
            "num_spec_verify_reqs": s.num_spec_verify_reqs,
            "avg_spec_accept_length": s.avg_spec_accept_length,
            **tier_hit_rates(s.num_prefill_tokens + s.num_cached_tokens, s.num_cached_tokens, tiers),
            **tiers,  # the hierarchical cache's host and storage counters
        }


def tier_hit_rates(prompt_tokens: int, cached_tokens: int, tiers: dict[str, int]) -> dict[str, float]:
    """The prompt tokens each tier served, as a fraction of all prompt tokens (they add up to
    cache_hit_rate); none without the hierarchical cache."""
    if not tiers:
        return {}
    host = tiers.get("host_tokens_loaded", 0)
    storage = tiers.get("storage_hit_tokens", 0)
    device = max(cached_tokens - host - storage, 0)
    total = prompt_tokens or 1
    return {
        "cache_hit_rate_device": device / total,
        "cache_hit_rate_host": host / total,
        "cache_hit_rate_storage": storage / total,
    }
