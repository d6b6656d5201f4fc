"""PrefillAdder: which requests fit into the next prefill batch (SGLang's budgets, chunking and
priority preemption). It decides and returns a `PrefillPlan`; the scheduler applies it."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum, auto

from radixengine.managers.req import Req
from radixengine.managers.schedule_batch import ScheduleBatch
from radixengine.managers.schedule_policy import has_prefix_tree, priority_sign
from radixengine.mem_cache.allocator import BaseTokenToKVPoolAllocator
from radixengine.mem_cache.base_prefix_cache import BasePrefixCache
from radixengine.mem_cache.radix_cache import TreeNode

# SGLang's constants (environment variables there).
CLIP_MAX_NEW_TOKENS = 4096  # clips only the reservation estimate, never the stop condition
IGNORE_EOS_RESERVE_TOKENS = 1


class AddReqResult(Enum):
    CONTINUE = auto()  # more requests may fit
    NO_TOKEN = auto()  # the pool is out of tokens
    OTHER = auto()  # the prefill or chunk budget is spent


@dataclass
class PrefillPlan:
    """One prefill round's decision, applied by the admission in one place: the admitted requests
    and the queue are untouched until then. Priority preemption is the exception: its victims are
    released from the running batch (KV freed or cached) while the round is computed, since the
    requests admitted after them need that room; applying the plan requeues them."""

    reqs: list[Req]  # admitted, in batch order (a continuing chunked request first)
    extend_lens: list[int]  # the tokens each computes this round
    chunked_req: Req | None  # the request whose prompt goes on in a later round, if any
    preempted: list[Req]  # running requests released to make room (requeued when applied)
    batch_is_full: bool  # stopped for want of rows or tokens
    new_tokens: int = 0  # for the Prefill log line: input tokens (page-rounded) and cache hits
    cached_tokens: int = 0


class PrefillAdder:
    """Admits requests into one prefill batch while three budgets hold: tokens left in the pool
    after reserving what running requests will still decode, input tokens per prefill batch,
    and the chunk. It decides; the scheduler applies its `plan`."""

    def __init__(
        self,
        page_size: int,
        tree_cache: BasePrefixCache,
        token_to_kv_pool_allocator: BaseTokenToKVPoolAllocator,
        running_batch: ScheduleBatch | None,
        new_token_ratio: float,
        rem_input_tokens: int,
        rem_chunk_tokens: int | None,
        mixed_with_decode_tokens: int = 0,
        priority_scheduling_preemption_threshold: int = 10,
        schedule_low_priority_values_first: bool = False,
        retract_decode_steps: int = 20,
        soft_priority_preemption: bool = False,
    ) -> None:
        self.page_size = page_size
        self.tree_cache = tree_cache
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.running_batch = running_batch
        self.new_token_ratio = new_token_ratio
        self.rem_input_tokens = rem_input_tokens - mixed_with_decode_tokens
        self.rem_chunk_tokens = (
            None if rem_chunk_tokens is None else rem_chunk_tokens - mixed_with_decode_tokens
        )
        self.rem_total_token_offset = self.cur_rem_token_offset = mixed_with_decode_tokens
        self.priority_scheduling_preemption_threshold = priority_scheduling_preemption_threshold
        self.priority_sign = priority_sign(schedule_low_priority_values_first)
        self.retract_decode_steps = retract_decode_steps
        self.soft_priority_preemption = soft_priority_preemption  # a victim's KV goes to the cache
        self.exact_ignore_eos = not has_prefix_tree(tree_cache)
        if running_batch is not None:
            self.rem_total_token_offset += sum(
                self._running_req_token_offset(r) for r in running_batch.reqs if not r.finished()
            )
        self.can_run_list: list[Req] = []
        self.extend_lens: list[int] = []
        self.preempt_list: list[Req] = []
        self.new_chunked_req: Req | None = None
        self.log_hit_tokens = self.log_input_tokens = 0
        self.req_states: list[tuple[float, int]] | None = None

    def plan(self, chunked_req: Req | None, batch_is_full: bool) -> PrefillPlan:
        """`chunked_req`: what `add_chunked_req` returned (None if there was none)."""
        assert self.new_chunked_req is None or chunked_req is None, "one chunked request at a time"
        return PrefillPlan(
            reqs=self.can_run_list,
            extend_lens=self.extend_lens,
            chunked_req=self.new_chunked_req or chunked_req,
            preempted=self.preempt_list,
            batch_is_full=batch_is_full,
            new_tokens=self.log_input_tokens,
            cached_tokens=self.log_hit_tokens,
        )

    def admitted(self, req: Req) -> bool:
        return bool(self.can_run_list) and self.can_run_list[-1] is req

    # Budgets -----------------------------------------------------------------------------------

    def _pool_tokens(self) -> int:
        return self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size()

    @property
    def rem_total_tokens(self) -> float:
        return self._pool_tokens() - self.rem_total_token_offset

    @property
    def cur_rem_tokens(self) -> float:
        return self._pool_tokens() - self.cur_rem_token_offset

    def ceil_paged_tokens(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size

    def budget_state(self) -> AddReqResult:
        if self.rem_total_tokens <= 0 or self.cur_rem_tokens <= 0:
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def _running_req_token_offset(self, req: Req) -> float:
        left = req.sampling_params.max_new_tokens - len(req.output_ids)
        return min(left, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio

    def _update_prefill_budget(self, prefix_len: int, extend_input_len: int, max_new_tokens: int) -> None:
        extend_input_len = self.ceil_paged_tokens(extend_input_len)
        self.rem_total_token_offset += extend_input_len + max_new_tokens
        self.cur_rem_token_offset += extend_input_len
        self.rem_input_tokens -= extend_input_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_input_len
        self.log_hit_tokens += prefix_len
        self.log_input_tokens += extend_input_len

    def _admit(self, req: Req, extend_len: int, chunked: bool = False) -> None:
        self.can_run_list.append(req)
        self.extend_lens.append(extend_len)
        if chunked:
            self.new_chunked_req = req

    @contextmanager
    def _lock_node(self, last_node: TreeNode | None):
        """Hold the prefix while checking, so evictable tokens it covers are not counted."""
        if last_node is None:
            yield
            return
        self.tree_cache.inc_lock_ref(last_node)
        try:
            yield
        finally:
            self.tree_cache.dec_lock_ref(last_node)

    @staticmethod
    def _max_new_estimate(req: Req) -> int:
        return min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)

    def _chunk_len(self) -> int:
        return self.rem_chunk_tokens // self.page_size * self.page_size

    # Admission ---------------------------------------------------------------------------------

    def add_chunked_req(self, req: Req) -> Req | None:
        """The next chunk of the request being prefilled in pieces. Returns the request while it
        is still truncated, None once this chunk completes it."""
        rem = min(self.rem_chunk_tokens, int(self.rem_total_tokens))
        if rem <= 0:
            return req  # no room this round; it keeps its prefix and row
        truncated = req.extend_input_len > rem
        extend_len = min(req.extend_input_len, rem)
        self._admit(req, extend_len)
        self._update_prefill_budget(0, extend_len, 0 if truncated else self._max_new_estimate(req))
        return req if truncated else None

    def add_one_req(self, req: Req) -> AddReqResult:
        if req.sampling_params.ignore_eos and self.exact_ignore_eos:
            return self.add_one_req_ignore_eos(req)

        total_tokens = req.extend_input_len + self._max_new_estimate(req)
        input_tokens = self.ceil_paged_tokens(req.extend_input_len)
        prefix_len = len(req.prefix_indices)
        if total_tokens >= self.rem_total_tokens:
            return AddReqResult.NO_TOKEN
        if input_tokens >= self.rem_input_tokens and self.can_run_list:
            return AddReqResult.OTHER  # the first request may go past the input budget

        with self._lock_node(req.last_node):
            if total_tokens >= self.rem_total_tokens:  # its prefix no longer counts as evictable
                return AddReqResult.NO_TOKEN
            if self.rem_chunk_tokens is None or input_tokens <= self.rem_chunk_tokens:
                self._admit(req, req.extend_input_len)
                self._inc_lock(req)
                self._update_prefill_budget(prefix_len, input_tokens, self._max_new_estimate(req))
            else:
                if self.new_chunked_req is not None:
                    return AddReqResult.OTHER  # one chunked request at a time
                trunc_len = self._chunk_len()
                if trunc_len <= 0:
                    return AddReqResult.OTHER
                self._admit(req, trunc_len, chunked=True)
                self._inc_lock(req)
                self._update_prefill_budget(prefix_len, trunc_len, 0)  # no output reserve yet
        return self.budget_state()

    def _inc_lock(self, req: Req) -> None:
        if req.last_node is not None:
            self.tree_cache.inc_lock_ref(req.last_node)  # held until cache_*_req

    def add_one_req_ignore_eos(self, req: Req) -> AddReqResult:
        """Without a tree and with ignore_eos, simulate exactly: sorted by tokens left, check
        that every request can finish with what the ones finishing before it give back."""
        if self.ceil_paged_tokens(req.extend_input_len) > min(self.cur_rem_tokens, self.rem_total_tokens):
            return AddReqResult.NO_TOKEN
        if not self._all_can_finish(req):
            return AddReqResult.NO_TOKEN
        if self.rem_chunk_tokens is None or req.extend_input_len <= self.rem_chunk_tokens:
            self._admit(req, req.extend_input_len)
            self._update_prefill_budget(0, req.extend_input_len, self._max_new_estimate(req))
        else:
            trunc_len = self._chunk_len()
            if trunc_len <= 0 or self.new_chunked_req is not None:
                return AddReqResult.OTHER
            self._admit(req, trunc_len, chunked=True)
            self._update_prefill_budget(0, trunc_len, 0)
        return self.budget_state()

    def _all_can_finish(self, req: Req) -> bool:
        def state(r: Req) -> tuple[float, int] | None:
            ratio = 1.0 if r.sampling_params.ignore_eos else self.new_token_ratio
            left = r.sampling_params.max_new_tokens * ratio - len(r.output_ids)
            return (left, len(r.origin_input_ids) + len(r.output_ids)) if left > 0 else None

        if self.req_states is None:
            others = (self.running_batch.reqs if self.running_batch is not None else []) + self.can_run_list
            self.req_states = [s for s in map(state, [req, *others]) if s is not None]
        elif (s := state(req)) is not None:
            self.req_states.append(s)
        self.req_states.sort(key=lambda x: x[0])

        cur_rem = self.cur_rem_tokens - self.ceil_paged_tokens(req.extend_input_len)
        freed = 0
        for i, (left, occupied) in enumerate(self.req_states):
            bs = len(self.req_states) - i
            if cur_rem + freed - left * bs <= IGNORE_EOS_RESERVE_TOKENS * bs:
                return False
            freed += occupied
        return True

    # Priority preemption -----------------------------------------------------------------------

    def preempt_to_schedule(self, req: Req) -> bool:
        """Move running requests whose priority is worse than `req`'s by more than the threshold
        back to the waiting queue, worst first, only as many as needed to fit `req`. Returns
        whether it did (and `req` can be tried)."""
        batch = self.running_batch
        if batch is None or batch.is_empty():
            return False
        victims = self._preemption_victims(req, batch)
        if not victims:
            return False
        victim_ids = {id(r) for r in victims}
        keep: list[int] = []
        released = 0
        for i, running in enumerate(batch.reqs):
            if id(running) in victim_ids:
                self.rem_total_token_offset -= self._running_req_token_offset(running)
                released += 1
                batch.release_req(
                    i, len(batch.reqs) - released, self.retract_decode_steps, self.soft_priority_preemption
                )
            else:
                keep.append(i)
        batch.filter_batch(keep_indices=keep)
        self.preempt_list.extend(victims)
        return True

    def _preemption_victims(self, req: Req, batch: ScheduleBatch) -> list[Req]:
        """The fewest worst running requests whose release fits `req`; none if that cannot be."""
        sign = self.priority_sign
        # Worst first: least important priority, then the most recent arrival.
        candidates = sorted(
            (r for r in batch.reqs if not r.finished() and r not in self.preempt_list),
            key=lambda r: (-r.priority * sign, -r.time_stats.wait_queue_entry_time),
        )
        need = req.extend_input_len + self._max_new_estimate(req) - self.rem_total_tokens
        victims: list[Req] = []
        for running in candidates:
            if (running.priority - req.priority) * sign <= self.priority_scheduling_preemption_threshold:
                break  # sorted worst first: no later one qualifies
            victims.append(running)
            need -= self._running_req_token_offset(running)
            if need <= 0:
                break
        return victims if need <= 0 else []
