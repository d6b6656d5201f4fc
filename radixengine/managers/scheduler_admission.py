"""Admission: which batch runs next (SGLang's get_next_batch_to_run).

A prefill round, in order: the chunked request's previous chunk goes to the cache; the last
prefill batch joins the running batch; the waiting requests are matched against the tree (once
each), ordered by the policy, and offered to a `PrefillAdder`, which returns a `PrefillPlan`
(which requests, how many tokens each, the chunked request, the preempted victims) that
`apply_prefill_plan` applies. Without a prefill, the running batch decodes
(`update_running_batch`, which retracts when the next step does not fit).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from radixengine.managers.prefill_adder import AddReqResult, PrefillAdder, PrefillPlan
from radixengine.managers.schedule_batch import Req, ScheduleBatch
from radixengine.managers.schedule_policy import IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD, PrefixTrie

if TYPE_CHECKING:
    from radixengine.managers.scheduler import Scheduler

logger = logging.getLogger("radixengine.managers.scheduler")


class SchedulerAdmissionMixin:
    def init_admission(self: Scheduler) -> None:
        self.waiting_queue: list[Req] = []
        self.running_batch: ScheduleBatch = self._new_batch([])
        self.chunked_req: Req | None = None
        # `batch_is_full` bookkeeping: departures from the running batch, and their count when
        # the last prefill round found it full (None: it did not).
        self._num_departures = 0
        self._full_at_departures: int | None = None

    @property
    def batch_is_full(self: Scheduler) -> bool:
        """The last prefill round stopped for want of rows or tokens and no request has left the
        running batch since: nothing new can be admitted yet (never so under priority
        preemption, which may make room, or with nothing running)."""
        return (
            self._full_at_departures == self._num_departures
            and not self.try_preemption
            and not self.running_batch.is_empty()
        )

    def _set_batch_is_full(self: Scheduler, full: bool) -> None:
        self._full_at_departures = self._num_departures if full else None

    def _note_departures(self: Scheduler, size_before: int, batch: ScheduleBatch) -> None:
        """Requests left the running batch (finished, retracted, a chunk handed back): rows and
        tokens were freed, so the next prefill round must look again."""
        if batch.batch_size() < size_before:
            self._num_departures += 1

    def get_next_batch_to_run(self: Scheduler) -> ScheduleBatch | None:
        if len(self.grammar_manager):
            self.move_ready_grammar_requests()
        self._end_chunk_round()
        if self.last_batch is not None and self.last_batch.forward_mode.is_extend():
            self._merge_last_prefill(self.last_batch)
        new_batch = self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        if self.running_batch.is_empty():
            return None
        self.running_batch = self.update_running_batch(self.running_batch)
        return None if self.running_batch.is_empty() else self.running_batch

    # The chunked request's life ----------------------------------------------------------------

    def _end_chunk_round(self: Scheduler) -> None:
        """The chunk launched last step goes to the cache (the request keeps its row for the next
        chunk); a chunked request aborted meanwhile is released."""
        req = self.chunked_req
        if req is None:
            return
        in_last_batch = self.last_batch is not None and any(r is req for r in self.last_batch.reqs)
        if req.to_abort:
            self._release_aborted_chunked_req(in_last_batch)
        elif in_last_batch:
            self.tree_cache.cache_unfinished_req(req)

    def _release_aborted_chunked_req(self: Scheduler, in_last_batch: bool) -> None:
        """Finish a request aborted between chunks: its KV covers the chunks computed so far."""
        req, self.chunked_req = self.chunked_req, None
        kv_len = len(req.fill_ids) if in_last_batch else len(req.prefix_indices)
        req.is_chunked = 0
        req.check_finished(self.eos_token_ids)
        req.time_stats.finish_time = time.perf_counter()
        if req.req_pool_idx is not None:
            # Not inserted: under overlap its last chunk may still be computing.
            with req.as_prefilled_upto(kv_len):
                self.tree_cache.cache_finished_req(req, is_insert=False)
        self._pending_outputs.append(req)

    def _merge_last_prefill(self: Scheduler, last: ScheduleBatch) -> None:
        """The last prefill batch's requests (but a still chunked one) start decoding."""
        launched_bs = last.batch_size()
        last.filter_batch(chunked_req_to_exclude=self.chunked_req)
        self._note_departures(launched_bs, last)
        if last.is_empty():
            return
        if self.running_batch.is_empty():
            self.running_batch = last
        else:
            self.running_batch.merge_batch(last)

    # The prefill round -------------------------------------------------------------------------

    def get_new_batch_prefill(self: Scheduler) -> ScheduleBatch | None:
        if not self._prefill_may_admit():
            return None
        return self.apply_prefill_plan(self.plan_prefill())

    def _num_allocatable_reqs(self: Scheduler, running_bs: int, chunked_in_batch: bool = False) -> int:
        """How many requests this prefill batch may hold (the chunked request keeps its row)."""
        rows = self.req_to_token_pool.available_size() + int(chunked_in_batch)
        return min(self.max_running_requests - running_bs, rows)

    def _prefill_may_admit(self: Scheduler) -> bool:
        if self.chunked_req is not None:
            return True
        if self.batch_is_full or not self.waiting_queue:
            return False
        if self._num_allocatable_reqs(len(self.running_batch.reqs)) <= 0 and not self.try_preemption:
            self._set_batch_is_full(True)
            return False
        return True

    def _match_and_order_waiting_queue(self: Scheduler) -> set[Req]:
        """Match every waiting request's prefix when the policy orders by it, then order the
        queue. Returns the requests matched (the others are matched when admission reaches them)."""
        if not self.waiting_queue:
            return set()
        match = self.policy.match_and_order(
            self.waiting_queue, lambda r: r.init_next_round_input(self.tree_cache)
        )
        return set(self.waiting_queue) if match else set()

    def _new_prefill_adder(self: Scheduler) -> PrefillAdder:
        return PrefillAdder(
            self.page_size,
            self.tree_cache,
            self.token_to_kv_pool_allocator,
            self.running_batch,
            self.new_token_ratio,
            self.max_prefill_tokens,
            self.chunked_prefill_size,
            mixed_with_decode_tokens=len(self.running_batch.reqs) if self.enable_mixed_chunk else 0,
            priority_scheduling_preemption_threshold=self.priority_scheduling_preemption_threshold,
            schedule_low_priority_values_first=self.schedule_low_priority_values_first,
            retract_decode_steps=self.retract_decode_steps,
            soft_priority_preemption=self.soft_priority_preemption,
        )

    def plan_prefill(self: Scheduler) -> PrefillPlan:
        matched = self._match_and_order_waiting_queue()
        adder = self._new_prefill_adder()
        chunked_req = self.chunked_req
        if chunked_req is not None:
            chunked_req.init_next_round_input()
            chunked_req = adder.add_chunked_req(chunked_req)
        trie = self._in_batch_prefix_trie(adder)
        full = self._admit_waiting(adder, trie, matched)
        return adder.plan(chunked_req, full)

    def _admit_waiting(
        self: Scheduler, adder: PrefillAdder, trie: PrefixTrie | None, matched: set[Req]
    ) -> bool:
        """Offer the ordered waiting requests to the adder until one does not fit. Returns
        whether the round stopped for want of rows or tokens."""
        running = self.running_batch
        chunked_in_batch = bool(adder.can_run_list)
        full = self.batch_is_full
        for req in self.waiting_queue:
            if req not in matched:
                req.init_next_round_input(self.tree_cache)
            if trie is not None and self._prefix_being_computed(req, trie):
                continue  # wait one round: it will hit the cache instead of computing it again
            if len(adder.can_run_list) >= self._num_allocatable_reqs(len(running.reqs), chunked_in_batch):
                full = True
            if full and not self._preempt_for(adder, req, matched):
                break
            if self.tree_cache.load_from_storage(req, req.fill_ids[: req.max_prefix_len()]):
                matched.clear()  # the load may have evicted what other requests matched
                req.init_next_round_input(self.tree_cache)
            res = self._add_one_req(adder, req, matched)
            if trie is not None and adder.admitted(req):
                trie.insert(req.fill_ids[: len(req.prefix_indices) + adder.extend_lens[-1]])
            if res != AddReqResult.CONTINUE:
                return full or res == AddReqResult.NO_TOKEN
        return full

    def _add_one_req(self: Scheduler, adder: PrefillAdder, req: Req, matched: set[Req]) -> AddReqResult:
        res = adder.add_one_req(req)
        if (
            res == AddReqResult.NO_TOKEN
            and not adder.admitted(req)
            and self._preempt_for(adder, req, matched)
        ):
            res = adder.add_one_req(req)
        return res

    def _preempt_for(self: Scheduler, adder: PrefillAdder, req: Req, matched: set[Req]) -> bool:
        """Preempt running requests to make room for `req` (priority scheduling only). Releasing
        them can evict tree nodes that earlier matches returned, so the requests are matched
        again: `req` now, the rest as admission reaches them."""
        if not (self.try_preemption and adder.preempt_to_schedule(req)):
            return False
        matched.clear()
        req.init_next_round_input(self.tree_cache)
        return True

    def apply_prefill_plan(self: Scheduler, plan: PrefillPlan) -> ScheduleBatch | None:
        """The one place a round's decision takes effect."""
        self._set_batch_is_full(plan.batch_is_full)
        self.stats.num_preempted_reqs += len(plan.preempted)
        continuing, self.chunked_req = self.chunked_req, plan.chunked_req
        if not plan.reqs:
            self._requeue(plan.preempted)
            return None
        for req, extend_len in zip(plan.reqs, plan.extend_lens):
            req.extend_input_len = extend_len
            req.fill_ids = req.fill_ids[: len(req.prefix_indices) + extend_len]
        admitted = {id(r) for r in plan.reqs}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        self._requeue(plan.preempted)
        if self.chunked_req is not None:
            self.chunked_req.is_chunked += 1
        self.log_prefill_stats(len(plan.reqs), plan.new_tokens, plan.cached_tokens)
        batch = self._new_batch(plan.reqs)
        cached_before = sum(r.cached_tokens for r in plan.reqs)
        batch.prepare_for_extend()
        self.policy.fair.on_prefill_batch(plan.reqs, continuing)
        self.stats.num_cached_tokens += sum(r.cached_tokens for r in plan.reqs) - cached_before
        self.stats.num_prefill_tokens += batch.extend_num_tokens
        if self.enable_mixed_chunk:
            self._mix_running_into(batch)
        return batch

    # In-batch prefix dedup ---------------------------------------------------------------------

    def _in_batch_prefix_trie(self: Scheduler, adder: PrefillAdder) -> PrefixTrie | None:
        """What this round (and any batch still in flight) is about to compute."""
        if not self.enable_in_batch_prefix_caching:
            return None
        trie = PrefixTrie()
        for req in self._inflight_prefill_reqs():
            trie.insert(req.fill_ids)
        for req, extend_len in zip(adder.can_run_list, adder.extend_lens):
            trie.insert(req.fill_ids[: len(req.prefix_indices) + extend_len])
        return trie

    def _inflight_prefill_reqs(self: Scheduler) -> list[Req]:
        """Requests of launched prefill batches whose results are not processed yet (their
        prefixes are not in the tree yet). None in the normal loop."""
        return [
            r
            for batch, _ in self.result_queue
            if batch.forward_mode.is_extend()
            for i, r in enumerate(batch.reqs)
            if not batch.is_decoding_req(i)
        ]

    def _prefix_being_computed(self: Scheduler, req: Req, trie: PrefixTrie) -> bool:
        shared = trie.match(req.fill_ids[: req.max_prefix_len()])
        shared = shared // self.page_size * self.page_size
        return shared - len(req.prefix_indices) >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD

    # Mixed chunk -------------------------------------------------------------------------------

    def _mix_running_into(self: Scheduler, batch: ScheduleBatch) -> None:
        """Mixed chunked prefill: the running requests take their decode step inside this prefill
        batch. Not with logprobs, and not when the decode step would not fit (then decode runs
        on its own next, where it can retract)."""
        running = self.running_batch
        if running.is_empty() or batch.return_logprob or running.return_logprob:
            return
        launched_bs = running.batch_size()
        running.filter_batch()
        self._note_departures(launched_bs, running)  # finished requests freed rows
        if running.is_empty() or not running.check_decode_mem():
            return
        running.prepare_for_decode()
        batch.mix_with_running(running)
        self.running_batch = self._new_batch([])

    # Decode ------------------------------------------------------------------------------------

    def update_running_batch(self: Scheduler, batch: ScheduleBatch) -> ScheduleBatch:
        # Measured before the filter: requests that finished last step free their rows and
        # tokens, and the next prefill round must see it (else batching turns static).
        initial_bs = batch.batch_size()
        batch.filter_batch()
        if not batch.is_empty():
            if batch.check_decode_mem():
                self.new_token_ratio = max(
                    self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio
                )
            else:
                self._retract_decode(batch)
        self._note_departures(initial_bs, batch)
        if not batch.is_empty():
            batch.prepare_for_decode()
        return batch

    def _retract_decode(self: Scheduler, batch: ScheduleBatch) -> None:
        old_ratio = self.new_token_ratio
        retracted, new_ratio, aborted = batch.retract_decode(
            self.retract_decode_steps, self.retraction_policy, self.schedule_low_priority_values_first
        )
        # An empty batch (its last request aborted) keeps the ratio: nothing to estimate from.
        self.new_token_ratio = new_ratio if not batch.is_empty() else old_ratio
        for req in aborted:
            req.time_stats.finish_time = time.perf_counter()
            self._pending_outputs.append(req)
            logger.warning("retract_decode: aborted the last request %s: out of KV memory", req.rid)
        self.stats.num_retracted_reqs += len(retracted)
        logger.info(
            "KV cache pool is full. Retract requests. #retracted_reqs: %d, #new_token_ratio: %.4f -> %.4f",
            len(retracted),
            old_ratio,
            self.new_token_ratio,
        )
        self._requeue(retracted)
