"""Admission (SGLang's get_new_batch_prefill): which waiting requests join a prefill batch.

A prefill round, in order: the chunked request's previous chunk goes to the cache; the last
prefill batch joins the running batch; the waiting requests are matched against the tree (once
each), ordered by the policy, and offered to a `PrefillAdder`, which returns a `PrefillPlan`
(which requests, how many tokens each, the chunked request, the preempted victims) that
`apply_prefill_plan` applies. The admission owns the chunked request and the `batch_is_full`
bookkeeping; the running batch is the scheduler's, handed in and returned in a `StepPlan`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from radixengine.managers.prefill_adder import AddReqResult, PrefillAdder, PrefillPlan
from radixengine.managers.schedule_batch import Req, ScheduleBatch
from radixengine.managers.schedule_policy import (
    IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD,
    PrefixTrie,
    SchedulePolicy,
)
from radixengine.managers.scheduler_components.metrics_reporter import MetricsReporter, QueueView
from radixengine.managers.scheduler_components.new_token_ratio import NewTokenRatioTracker
from radixengine.managers.scheduler_components.output_streamer import OutputStreamer
from radixengine.managers.scheduler_components.request_intake import RequestIntake
from radixengine.managers.scheduler_components.scheduler_stats import SchedulerStats
from radixengine.managers.scheduler_components.step_plan import StepPlan
from radixengine.managers.scheduler_components.step_recovery import StepRequestsError
from radixengine.mem_cache.allocator import BaseTokenToKVPoolAllocator
from radixengine.mem_cache.base_prefix_cache import BasePrefixCache
from radixengine.mem_cache.memory_pool import ReqToTokenPool
from radixengine.server_args import ServerArgs
from radixengine.utils.fault_injection import fault_point

NewBatch = Callable[[list[Req]], ScheduleBatch]
PREFETCH_POLL_S = 0.002  # a round that runs nothing waits this long for a storage prefetch


@dataclass(frozen=True)
class AdmissionConfig:
    page_size: int
    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int | None
    enable_mixed_chunk: bool
    try_preemption: bool  # priority scheduling: a round may preempt running requests
    priority_scheduling_preemption_threshold: int
    schedule_low_priority_values_first: bool
    retract_decode_steps: int
    soft_priority_preemption: bool
    enable_in_batch_prefix_caching: bool
    eos_token_ids: frozenset[int]

    @classmethod
    def from_server_args(
        cls,
        args: ServerArgs,
        max_running_requests: int,
        overlap: bool,
        in_batch_prefix_caching: bool,
        eos_token_ids: frozenset[int],
    ) -> AdmissionConfig:
        return cls(
            page_size=args.page_size,
            max_running_requests=max_running_requests,
            max_prefill_tokens=args.max_prefill_tokens,
            chunked_prefill_size=args.effective_chunked_prefill_size,
            # Not under overlap with speculation: a verify step cannot be mixed into a prefill.
            enable_mixed_chunk=args.enable_mixed_chunk and not (overlap and args.speculative_algorithm),
            try_preemption=args.enable_priority_scheduling,
            priority_scheduling_preemption_threshold=args.priority_scheduling_preemption_threshold,
            schedule_low_priority_values_first=args.schedule_low_priority_values_first,
            retract_decode_steps=args.retract_decode_steps,
            soft_priority_preemption=args.soft_priority_preemption,
            enable_in_batch_prefix_caching=in_batch_prefix_caching,
            eos_token_ids=eos_token_ids,
        )


@dataclass(frozen=True)
class AdmissionPools:
    tree_cache: BasePrefixCache
    allocator: BaseTokenToKVPoolAllocator
    req_to_token_pool: ReqToTokenPool


@dataclass(frozen=True)
class AdmissionPeers:
    """The components admission reads from and reports to."""

    intake: RequestIntake
    policy: SchedulePolicy
    ratio: NewTokenRatioTracker
    stats: SchedulerStats
    metrics: MetricsReporter
    streamer: OutputStreamer
    new_batch: NewBatch
    inflight_prefill_reqs: Callable[[], list[Req]]  # launched prefills not processed yet


class PrefillAdmission:
    def __init__(self, config: AdmissionConfig, pools: AdmissionPools, peers: AdmissionPeers) -> None:
        self.config = config
        self.pools = pools
        self.peers = peers
        self.chunked_req: Req | None = None
        # `batch_is_full` bookkeeping: departures from the running batch, and their count when
        # the last prefill round found it full (None: it did not).
        self.num_departures = 0
        self.full_at_departures: int | None = None
        self.waiting_for_prefetch = False  # this round skipped requests whose prefetch runs

    @property
    def waiting_queue(self) -> list[Req]:
        return self.peers.intake.waiting_queue

    def reset(self) -> None:
        """After a failed step: no chunked request, and the next round looks again."""
        self.chunked_req = None
        self.full_at_departures = None

    def batch_is_full(self, running: ScheduleBatch) -> bool:
        """The last prefill round stopped for want of rows or tokens and no request has left the
        running batch since: nothing new can be admitted yet (never so under priority
        preemption, which may make room, or with nothing running)."""
        return (
            self.full_at_departures == self.num_departures
            and not self.config.try_preemption
            and not running.is_empty()
        )

    def _set_batch_is_full(self, full: bool) -> None:
        self.full_at_departures = self.num_departures if full else None

    def note_departures(self, size_before: int, batch: ScheduleBatch) -> None:
        """Requests left the running batch (finished, retracted, a chunk handed back): rows and
        tokens were freed, so the next prefill round must look again."""
        if batch.batch_size() < size_before:
            self.num_departures += 1

    # The chunked request's life ----------------------------------------------------------------

    def end_chunk_round(self, last_batch: ScheduleBatch | None) -> None:
        """The chunk launched last step goes to the cache (the request keeps its row for the next
        chunk); a chunked request aborted meanwhile is released."""
        req = self.chunked_req
        if req is None:
            return
        in_last_batch = last_batch is not None and any(r is req for r in last_batch.reqs)
        if req.to_abort:
            self._release_aborted_chunked_req(in_last_batch)
        elif in_last_batch:
            self.pools.tree_cache.cache_unfinished_req(req)

    def _release_aborted_chunked_req(self, in_last_batch: bool) -> None:
        """Finish a request aborted between chunks: its KV covers the chunks computed so far."""
        req, self.chunked_req = self.chunked_req, None
        kv_len = len(req.fill_ids) if in_last_batch else len(req.prefix_indices)
        req.is_chunked = 0
        req.check_finished(self.config.eos_token_ids)
        req.time_stats.finish_time = time.perf_counter()
        if req.req_pool_idx is not None:
            # Not inserted: under overlap its last chunk may still be computing.
            with req.as_prefilled_upto(kv_len):
                self.pools.tree_cache.cache_finished_req(req, is_insert=False)
        self.peers.streamer.add(req)

    def merge_last_prefill(self, last: ScheduleBatch, running: ScheduleBatch) -> ScheduleBatch:
        """The last prefill batch's requests (but a still chunked one) start decoding. Returns
        the running batch after."""
        launched_bs = last.batch_size()
        last.filter_batch(chunked_req_to_exclude=self.chunked_req)
        self.note_departures(launched_bs, last)
        if last.is_empty():
            return running
        if running.is_empty():
            return last
        running.merge_batch(last)
        return running

    # The prefill round -------------------------------------------------------------------------

    def get_new_batch_prefill(self, running: ScheduleBatch) -> StepPlan:
        if not self._prefill_may_admit(running):
            return StepPlan(None, running)
        self.waiting_for_prefetch = False
        plan = self.apply_prefill_plan(self.plan_prefill(running), running)
        if plan.batch is None and plan.running_batch.is_empty() and self.waiting_for_prefetch:
            # Nothing runs and queued requests wait for storage reads: wait briefly for a page
            # instead of spinning.
            self.pools.tree_cache.wait_for_prefetch(PREFETCH_POLL_S)
        return plan

    def _num_allocatable_reqs(self, running_bs: int, chunked_in_batch: bool = False) -> int:
        """How many requests this prefill batch may hold (the chunked request keeps its row)."""
        rows = self.pools.req_to_token_pool.available_size() + int(chunked_in_batch)
        return min(self.config.max_running_requests - running_bs, rows)

    def _prefill_may_admit(self, running: ScheduleBatch) -> bool:
        if self.chunked_req is not None:
            return True
        if self.batch_is_full(running) or not self.waiting_queue:
            return False
        if self._num_allocatable_reqs(len(running.reqs)) <= 0 and not self.config.try_preemption:
            self._set_batch_is_full(True)
            return False
        return True

    def _match_and_order_waiting_queue(self) -> set[Req]:
        """Match every waiting request's prefix when the policy orders by it, then order the
        queue. Returns the requests matched (the others are matched when admission reaches them)."""
        if not self.waiting_queue:
            return set()
        tree_cache = self.pools.tree_cache
        match = self.peers.policy.match_and_order(
            self.waiting_queue, lambda r: r.init_next_round_input(tree_cache)
        )
        return set(self.waiting_queue) if match else set()

    def _new_prefill_adder(self, running: ScheduleBatch) -> PrefillAdder:
        c = self.config
        return PrefillAdder(
            c.page_size,
            self.pools.tree_cache,
            self.pools.allocator,
            running,
            self.peers.ratio.value,
            c.max_prefill_tokens,
            c.chunked_prefill_size,
            mixed_with_decode_tokens=len(running.reqs) if c.enable_mixed_chunk else 0,
            priority_scheduling_preemption_threshold=c.priority_scheduling_preemption_threshold,
            schedule_low_priority_values_first=c.schedule_low_priority_values_first,
            retract_decode_steps=c.retract_decode_steps,
            soft_priority_preemption=c.soft_priority_preemption,
        )

    def plan_prefill(self, running: ScheduleBatch) -> PrefillPlan:
        """This round's decision; nothing but the preempted victims changes until it is applied."""
        matched = self._match_and_order_waiting_queue()
        adder = self._new_prefill_adder(running)
        chunked_req = self.chunked_req
        if chunked_req is not None:
            chunked_req.init_next_round_input()
            chunked_req = adder.add_chunked_req(chunked_req)
        trie = self._in_batch_prefix_trie(adder)
        full = self._admit_waiting(adder, trie, matched, running)
        return adder.plan(chunked_req, full)

    def _admit_waiting(
        self, adder: PrefillAdder, trie: PrefixTrie | None, matched: set[Req], running: ScheduleBatch
    ) -> bool:
        """Offer the ordered waiting requests to the adder until one does not fit. Returns
        whether the round stopped for want of rows or tokens."""
        chunked_in_batch = bool(adder.can_run_list)
        full = self.batch_is_full(running)
        for req in self.waiting_queue:
            if not req.interactive and self._interactive_waiting(adder):
                break  # batch lines come last in the queue: none runs while an interactive one waits
            if req not in matched:
                req.init_next_round_input(self.pools.tree_cache)
            if self._waits_this_round(req, trie, adder, running):
                continue
            if len(adder.can_run_list) >= self._num_allocatable_reqs(len(running.reqs), chunked_in_batch):
                full = True
            if full and not self._preempt_for(adder, req, matched):
                break
            if self._load_from_storage(req):
                matched.clear()  # the load may have evicted what other requests matched
                req.init_next_round_input(self.pools.tree_cache)
            res = self._add_one_req(adder, req, matched)
            if trie is not None and adder.admitted(req):
                trie.insert(req.fill_ids[: len(req.prefix_indices) + adder.extend_lens[-1]], req.extra_key)
            if res != AddReqResult.CONTINUE:
                return full or res == AddReqResult.NO_TOKEN
        return full

    def _waits_this_round(
        self, req: Req, trie: PrefixTrie | None, adder: PrefillAdder, running: ScheduleBatch
    ) -> bool:
        """Whether `req` stays queued this round: a request of this batch computes its prefix
        (it will hit the cache next round instead), its adapter would exceed
        --max-loras-per-batch, or its pages are still read from storage."""
        if trie is not None and self._prefix_being_computed(req, trie):
            return True
        if not self._lora_fits(req, adder, running):
            return True
        if not self.pools.tree_cache.check_prefetch_progress(req.rid):
            self.waiting_for_prefetch = True
            return True
        return False

    def _interactive_waiting(self, adder: PrefillAdder) -> bool:
        """Whether an interactive request is waiting and not admitted this round (checked at batch
        lines only, of which the runner keeps at most --batch-max-running in the engine)."""
        admitted = {id(r) for r in adder.can_run_list}
        return any(r.interactive and id(r) not in admitted for r in self.waiting_queue)

    def _load_from_storage(self, req: Req) -> int:
        """The hierarchical cache's load of the request's prefix; a failure is this request's."""
        try:
            fault_point("cache_load")
            return self.pools.tree_cache.load_from_storage(req, req.fill_ids[: req.max_prefix_len()])
        except Exception as e:
            raise StepRequestsError([req], e) from e

    def _lora_fits(self, req: Req, adder: PrefillAdder, running: ScheduleBatch) -> bool:
        batch = [r.lora_id for r in running.reqs if r not in adder.preempt_list]
        return self.peers.intake.lora.fits(batch + [r.lora_id for r in adder.can_run_list], req.lora_id)

    def _add_one_req(self, adder: PrefillAdder, req: Req, matched: set[Req]) -> AddReqResult:
        res = adder.add_one_req(req)
        if (
            res == AddReqResult.NO_TOKEN
            and not adder.admitted(req)
            and self._preempt_for(adder, req, matched)
        ):
            res = adder.add_one_req(req)
        return res

    def _preempt_for(self, adder: PrefillAdder, req: Req, matched: set[Req]) -> bool:
        """Preempt running requests to make room for `req` (priority scheduling only). Releasing
        them can evict tree nodes that earlier matches returned, so the requests are matched
        again: `req` now, the rest as admission reaches them."""
        if not (self.config.try_preemption and adder.preempt_to_schedule(req)):
            return False
        matched.clear()
        req.init_next_round_input(self.pools.tree_cache)
        return True

    def apply_prefill_plan(self, plan: PrefillPlan, running: ScheduleBatch) -> StepPlan:
        """The one place a round's decision takes effect."""
        self._set_batch_is_full(plan.batch_is_full)
        self.peers.stats.add_preempted(len(plan.preempted))
        continuing, self.chunked_req = self.chunked_req, plan.chunked_req
        intake = self.peers.intake
        if not plan.reqs:
            intake.requeue(plan.preempted)
            return StepPlan(None, running)
        for req, extend_len in zip(plan.reqs, plan.extend_lens):
            req.extend_input_len = extend_len
            req.fill_ids = req.fill_ids[: len(req.prefix_indices) + extend_len]
        intake.remove_admitted(plan.reqs)
        intake.requeue(plan.preempted)
        if plan.chunked_req is not None:
            plan.chunked_req.is_chunked += 1
        queues = QueueView(running.reqs, self.waiting_queue)
        self.peers.metrics.log_prefill_stats(len(plan.reqs), plan.new_tokens, plan.cached_tokens, queues)
        batch = self._prepare_batch(plan, continuing)
        if self.config.enable_mixed_chunk:
            running = self._mix_running_into(batch, running)
        return StepPlan(batch, running)

    def _prepare_batch(self, plan: PrefillPlan, continuing: Req | None) -> ScheduleBatch:
        batch = self.peers.new_batch(plan.reqs)
        cached_before = sum(r.cached_tokens for r in plan.reqs)
        batch.prepare_for_extend()
        self.peers.policy.fair.on_prefill_batch(plan.reqs, continuing)
        cached = sum(r.cached_tokens for r in plan.reqs) - cached_before
        self.peers.stats.add_prefill(batch.extend_num_tokens, cached)
        return batch

    # In-batch prefix dedup ---------------------------------------------------------------------

    def _in_batch_prefix_trie(self, adder: PrefillAdder) -> PrefixTrie | None:
        """What this round (and any batch still in flight) is about to compute."""
        if not self.config.enable_in_batch_prefix_caching:
            return None
        trie = PrefixTrie()
        for req in self.peers.inflight_prefill_reqs():
            trie.insert(req.fill_ids, req.extra_key)
        for req, extend_len in zip(adder.can_run_list, adder.extend_lens):
            trie.insert(req.fill_ids[: len(req.prefix_indices) + extend_len], req.extra_key)
        return trie

    def _prefix_being_computed(self, req: Req, trie: PrefixTrie) -> bool:
        page = self.config.page_size
        shared = trie.match(req.fill_ids[: req.max_prefix_len()], req.extra_key) // page * page
        return shared - len(req.prefix_indices) >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD

    # Mixed chunk -------------------------------------------------------------------------------

    def _mix_running_into(self, batch: ScheduleBatch, running: ScheduleBatch) -> ScheduleBatch:
        """Mixed chunked prefill: the running requests take their decode step inside this prefill
        batch. Not with logprobs, and not when the decode step would not fit (then decode runs
        on its own next, where it can retract). Returns the running batch after."""
        if running.is_empty() or batch.return_logprob or running.return_logprob:
            return running
        launched_bs = running.batch_size()
        running.filter_batch()
        self.note_departures(launched_bs, running)  # finished requests freed rows
        if running.is_empty() or not running.check_decode_mem():
            return running
        running.prepare_for_decode()
        batch.mix_with_running(running)
        return self.peers.new_batch([])
