"""SchedulePolicy (the order of the waiting queue) and PrefillAdder (which requests fit into the
next prefill batch), with SGLang's policies, budgets and priority preemption."""

from __future__ import annotations

import random
import sys
from collections import defaultdict
from contextlib import contextmanager
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

from radixengine.managers.fair_policy import FairPolicy
from radixengine.managers.schedule_batch import Req, ScheduleBatch

if TYPE_CHECKING:
    from radixengine.server_args import ServerArgs

# SGLang's constants (environment variables there).
CLIP_MAX_NEW_TOKENS = 4096  # clips only the reservation estimate, never the stop condition
IGNORE_EOS_RESERVE_TOKENS = 1
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32  # only requests with a short cached prefix are checked
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32  # tokens another waiting request would share


class CacheAwarePolicy(Enum):
    LPM = "lpm"
    DFS_WEIGHT = "dfs-weight"
    # Ordered by managers/fair_policy.py
    HRRN = "hrrn"
    SHORTEST_PREFILL_FIRST = "shortest-prefill-first"
    DLPM = "dlpm"


class CacheAgnosticPolicy(Enum):
    FCFS = "fcfs"
    LOF = "lof"
    RANDOM = "random"


Policy = CacheAwarePolicy | CacheAgnosticPolicy


def lowest_priority_value(low_values_first: bool) -> int:
    """The least important priority: what a request without one gets."""
    return sys.maxsize if low_values_first else -sys.maxsize - 1


# In-batch prefix tracking ------------------------------------------------------------------------


def _common_prefix_len(edge: list[int], key: list[int], start: int) -> int:
    n = min(len(edge), len(key) - start)
    if edge[:n] == key[start : start + n]:
        return n
    i, block = 0, 32
    while i + block <= n and edge[i : i + block] == key[start + i : start + i + block]:
        i += block
    while edge[i] == key[start + i]:
        i += 1
    return i


class PrefixTrie:
    """Token sequences without KV: which prefixes other requests of this round (or of a batch
    still in flight) are about to compute. A compressed trie; a node is {first token: [edge,
    children]}."""

    def __init__(self) -> None:
        self.root: dict[int, list] = {}

    def reset(self) -> None:
        self.root = {}

    def match(self, key: list[int]) -> int:
        node, i = self.root, 0
        while i < len(key):
            child = node.get(key[i])
            if child is None:
                break
            edge, children = child
            k = _common_prefix_len(edge, key, i)
            i += k
            if k < len(edge):
                break
            node = children
        return i

    def insert(self, key: list[int]) -> None:
        node, i = self.root, 0
        while i < len(key):
            child = node.get(key[i])
            if child is None:
                node[key[i]] = [key[i:], {}]
                return
            edge, children = child
            k = _common_prefix_len(edge, key, i)
            if k < len(edge):  # split the edge at k
                child[0], child[1] = edge[:k], {edge[k]: [edge[k:], children]}
            node, i = child[1], i + k


# Policy ----------------------------------------------------------------------------------------


class SchedulePolicy:
    def __init__(
        self,
        policy: str,
        tree_cache: Any,
        enable_priority_scheduling: bool = False,
        schedule_low_priority_values_first: bool = False,
        lpm_fallback_queue_len: int = 128,
        enable_in_batch_prefix_caching: bool = True,
        rng: random.Random | None = None,
        fair: FairPolicy | None = None,
    ) -> None:
        self.tree_cache = tree_cache
        self.policy = self._validate_and_adjust_policy(policy, tree_cache)
        self.enable_priority_scheduling = enable_priority_scheduling
        self.low_values_first = schedule_low_priority_values_first
        # Sort key sign: priority * sign ascending puts the most important first.
        self.priority_sign = 1 if schedule_low_priority_values_first else -1
        self.lpm_fallback_queue_len = lpm_fallback_queue_len
        self.enable_in_batch_prefix_caching = enable_in_batch_prefix_caching
        self.rng = rng or random.Random(0)
        self.waiting_queue_radix_tree = PrefixTrie()
        self.fair = fair or FairPolicy()

    @staticmethod
    def _validate_and_adjust_policy(policy: str, tree_cache: Any) -> Policy:
        try:
            parsed: Policy = CacheAwarePolicy(policy)
        except ValueError:
            try:
                parsed = CacheAgnosticPolicy(policy)
            except ValueError:
                names = [p.value for p in (*CacheAgnosticPolicy, *CacheAwarePolicy)]
                raise ValueError(f"unknown schedule policy {policy!r}; one of {', '.join(names)}") from None
        if isinstance(parsed, CacheAwarePolicy) and getattr(tree_cache, "disable", True):
            return CacheAgnosticPolicy.FCFS  # no tree to be aware of
        return parsed

    def _determine_active_policy(self, waiting_queue: list[Req]) -> Policy:
        matching = (CacheAwarePolicy.LPM, CacheAwarePolicy.HRRN, CacheAwarePolicy.SHORTEST_PREFILL_FIRST)
        if self.policy in matching and len(waiting_queue) > self.lpm_fallback_queue_len:
            return CacheAgnosticPolicy.FCFS  # matching every request costs too much
        return self.policy

    def calc_priority(self, waiting_queue: list[Req]) -> bool:
        """Sort the waiting queue in place. Returns whether the prefixes were matched (then
        `init_next_round_input` need not match again)."""
        policy = self._determine_active_policy(waiting_queue)
        prefix_computed = False
        self.fair.observe_queue(waiting_queue)
        if policy == CacheAwarePolicy.DLPM and len(waiting_queue) > self.lpm_fallback_queue_len:
            self.fair.sort("dlpm-unmatched", waiting_queue, set())  # too long to match: deficits only
        elif isinstance(policy, CacheAwarePolicy):
            deprioritized = self._compute_prefix_matches(waiting_queue)
            prefix_computed = True
            if self.fair.handles(policy.value):
                self.fair.sort(policy.value, waiting_queue, deprioritized)
            elif policy == CacheAwarePolicy.LPM:
                self._sort_by_longest_prefix(waiting_queue, deprioritized)
            else:
                self._sort_by_dfs_weight(waiting_queue, self.tree_cache)
        elif policy == CacheAgnosticPolicy.LOF:
            waiting_queue.sort(key=lambda r: -r.sampling_params.max_new_tokens)
        elif policy == CacheAgnosticPolicy.RANDOM:
            self.rng.shuffle(waiting_queue)
        if self.enable_priority_scheduling:
            # Stable: within a priority, the policy's order (FCFS: arrival).
            if policy == CacheAgnosticPolicy.FCFS:
                waiting_queue.sort(
                    key=lambda r: (r.priority * self.priority_sign, r.time_stats.wait_queue_entry_time)
                )
            else:
                waiting_queue.sort(key=lambda r: r.priority * self.priority_sign)
        return prefix_computed

    def _compute_prefix_matches(self, waiting_queue: list[Req]) -> set[Req]:
        """Match every waiting request against the tree; with in-batch prefix caching, a
        request with a short cached prefix that another waiting request shares by at least the
        threshold is deprioritized (it will hit the cache once that one has run)."""
        self.waiting_queue_radix_tree.reset()
        deprioritized: set[Req] = set()
        for req in waiting_queue:
            prefix_ids = req.adjust_max_prefix_ids()
            match = self.tree_cache.match_prefix(prefix_ids)
            req.prefix_indices, req.last_node = match.device_indices, match.last_node
            req.last_matched_prefix_len = len(req.prefix_indices)
            if not self.enable_in_batch_prefix_caching:
                continue
            if len(req.prefix_indices) <= IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD:
                in_batch = self.waiting_queue_radix_tree.match(prefix_ids)
                if in_batch >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD:
                    deprioritized.add(req)
                else:
                    self.waiting_queue_radix_tree.insert(prefix_ids)
        return deprioritized

    @staticmethod
    def _sort_by_longest_prefix(waiting_queue: list[Req], deprioritized: set[Req]) -> None:
        waiting_queue.sort(key=lambda r: float("inf") if r in deprioritized else -len(r.prefix_indices))

    @staticmethod
    def _sort_by_dfs_weight(waiting_queue: list[Req], tree_cache: Any) -> None:
        """Depth-first over the tree, heavier subtrees first; a node's own requests after its
        children (post-order). weight = waiting requests whose last node is in the subtree."""
        last_node_to_reqs: dict[Any, list[Req]] = defaultdict(list)
        for req in waiting_queue:
            last_node_to_reqs[req.last_node].append(req)
        weight: dict[Any, int] = defaultdict(int)
        for node, reqs in last_node_to_reqs.items():
            weight[node] = len(reqs)
        root = tree_cache.root_node
        _calc_weight(root, weight)
        before = list(waiting_queue)
        waiting_queue.clear()
        _get_dfs_priority(root, weight, last_node_to_reqs, waiting_queue)
        if len(waiting_queue) != len(before):  # a last node off the tree: keep those requests
            seen = set(waiting_queue)
            waiting_queue.extend(r for r in before if r not in seen)


def _children(node: Any) -> list[Any]:
    return list(node.children.values())


def _calc_weight(root: Any, weight: dict[Any, int]) -> None:
    order: list[tuple[Any, Any]] = []
    stack: list[tuple[Any, Any]] = [(root, None)]
    while stack:  # iterative: trees can be deep
        node, parent = stack.pop()
        order.append((node, parent))
        stack.extend((c, node) for c in _children(node))
    for node, parent in reversed(order):  # children before parents
        if parent is not None:
            weight[parent] += weight[node]


def _get_dfs_priority(
    root: Any, weight: dict[Any, int], node_to_reqs: dict[Any, list[Req]], out: list[Req]
) -> None:
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            out.extend(node_to_reqs.get(node, ()))
            continue
        stack.append((node, True))
        children = sorted((c for c in _children(node) if weight.get(c, 0) > 0), key=lambda c: -weight[c])
        stack.extend((c, False) for c in reversed(children))


# PrefillAdder ----------------------------------------------------------------------------------


class AddReqResult(Enum):
    CONTINUE = auto()  # more requests may fit
    NO_TOKEN = auto()  # the pool is out of tokens
    OTHER = auto()  # the prefill or chunk budget is spent


class PrefillAdder:
    """Admits requests into one prefill batch while three budgets hold: tokens left in the pool
    after reserving what running requests will still decode, input tokens per prefill batch,
    and the chunk."""

    def __init__(
        self,
        page_size: int,
        tree_cache: Any,
        token_to_kv_pool_allocator: Any,
        running_batch: ScheduleBatch | None,
        new_token_ratio: float,
        rem_input_tokens: int,
        rem_chunk_tokens: int | None,
        mixed_with_decode_tokens: int = 0,
        priority_scheduling_preemption_threshold: int = 10,
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
        self.rem_total_token_offset = mixed_with_decode_tokens
        self.cur_rem_token_offset = mixed_with_decode_tokens
        self.priority_scheduling_preemption_threshold = priority_scheduling_preemption_threshold
        if running_batch is not None:
            self.rem_total_token_offset += sum(
                self._running_req_token_offset(r) for r in running_batch.reqs if not r.finished()
            )
        self.can_run_list: list[Req] = []
        self.preempt_list: list[Req] = []
        self.new_chunked_req: Req | None = None
        self.log_hit_tokens = 0
        self.log_input_tokens = 0
        self.req_states: list[tuple[float, int]] | None = None

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

    @contextmanager
    def _lock_node(self, last_node: Any):
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

    # Admission ---------------------------------------------------------------------------------

    def add_chunked_req(self, req: Req) -> Req | None:
        """The next chunk of the request being prefilled in pieces. Returns the request while it
        is still truncated, None once this chunk completes it."""
        rem = min(self.rem_chunk_tokens, int(self.rem_total_tokens))
        if rem <= 0:
            return req  # no room this round; it keeps its prefix and row
        truncated = req.extend_input_len > rem
        req.extend_input_len = min(req.extend_input_len, rem)
        req.fill_ids = req.fill_ids[: len(req.prefix_indices) + req.extend_input_len]
        self.can_run_list.append(req)
        self._update_prefill_budget(0, req.extend_input_len, 0 if truncated else self._max_new_estimate(req))
        return req if truncated else None

    def add_one_req(
        self, req: Req, has_chunked_req: bool, truncation_align_size: int | None = None
    ) -> AddReqResult:
        if req.sampling_params.ignore_eos and getattr(self.tree_cache, "disable", False):
            return self.add_one_req_ignore_eos(req, has_chunked_req)

        total_tokens = req.extend_input_len + self._max_new_estimate(req)
        input_tokens = self.ceil_paged_tokens(req.extend_input_len)
        real_input_tokens = self.ceil_paged_tokens(req.extend_input_len - req.host_hit_length)
        prefix_len = len(req.prefix_indices)
        if total_tokens >= self.rem_total_tokens:
            return AddReqResult.NO_TOKEN
        if real_input_tokens >= self.rem_input_tokens and self.can_run_list:
            return AddReqResult.OTHER  # the first request may go past the input budget

        with self._lock_node(req.last_node):
            if total_tokens >= self.rem_total_tokens:  # its prefix no longer counts as evictable
                return AddReqResult.NO_TOKEN
            if self.rem_chunk_tokens is None or input_tokens <= self.rem_chunk_tokens:
                self.can_run_list.append(req)
                self._inc_lock(req)
                self._update_prefill_budget(prefix_len, input_tokens, self._max_new_estimate(req))
            else:
                if self.new_chunked_req is not None:
                    return AddReqResult.OTHER  # one chunked request at a time
                trunc_len = self.rem_chunk_tokens // self.page_size * self.page_size
                if truncation_align_size is not None:
                    trunc_len = trunc_len // truncation_align_size * truncation_align_size
                if trunc_len <= 0:
                    return AddReqResult.OTHER
                req.extend_input_len = trunc_len
                req.fill_ids = req.fill_ids[: prefix_len + trunc_len]
                self.can_run_list.append(req)
                self.new_chunked_req = req
                self._inc_lock(req)
                self._update_prefill_budget(prefix_len, trunc_len, 0)  # no output reserve yet
        return self.budget_state()

    def _inc_lock(self, req: Req) -> None:
        if req.last_node is not None:
            self.tree_cache.inc_lock_ref(req.last_node)  # held until cache_*_req

    def add_one_req_ignore_eos(self, req: Req, has_chunked_req: bool) -> AddReqResult:
        """Without a tree and with ignore_eos, simulate exactly: sorted by tokens left, check
        that every request can finish with what the ones finishing before it give back."""
        if self.ceil_paged_tokens(req.extend_input_len) > min(self.cur_rem_tokens, self.rem_total_tokens):
            return AddReqResult.NO_TOKEN

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
                return AddReqResult.NO_TOKEN
            freed += occupied

        if self.rem_chunk_tokens is None or req.extend_input_len <= self.rem_chunk_tokens:
            self.can_run_list.append(req)
            self._update_prefill_budget(0, req.extend_input_len, self._max_new_estimate(req))
        else:
            trunc_len = self.rem_chunk_tokens // self.page_size * self.page_size
            if trunc_len <= 0 or self.new_chunked_req is not None:
                return AddReqResult.OTHER
            req.extend_input_len = trunc_len
            req.fill_ids = req.fill_ids[: len(req.prefix_indices) + trunc_len]
            self.can_run_list.append(req)
            self.new_chunked_req = req
            self._update_prefill_budget(0, trunc_len, 0)
        return self.budget_state()

    # Priority preemption -----------------------------------------------------------------------

    def preempt_to_schedule(self, req: Req, server_args: ServerArgs) -> bool:
        """Move running requests whose priority is worse than `req`'s by more than the threshold
        back to the waiting queue, worst first, only as many as needed to fit `req`. Returns
        whether it did (and `req` can be tried)."""
        batch = self.running_batch
        if batch is None or batch.is_empty():
            return False
        low_first = server_args.schedule_low_priority_values_first
        sign = 1 if low_first else -1
        # Worst first: least important priority, then the most recent arrival.
        candidates = sorted(
            (r for r in batch.reqs if not r.finished() and r not in self.preempt_list),
            key=lambda r: (-r.priority * sign, -r.time_stats.wait_queue_entry_time),
        )
        need = req.extend_input_len + self._max_new_estimate(req) - self.rem_total_tokens
        victims: list[Req] = []
        for running in candidates:
            diff = (running.priority - req.priority) * sign
            if diff <= self.priority_scheduling_preemption_threshold:
                break  # sorted worst first: no later one qualifies
            victims.append(running)
            need -= self._running_req_token_offset(running)
            if need <= 0:
                break
        if not victims or need > 0:
            return False

        victim_ids = {id(r) for r in victims}
        keep: list[int] = []
        released = 0
        for i, running in enumerate(batch.reqs):
            if id(running) in victim_ids:
                self.rem_total_token_offset -= self._running_req_token_offset(running)
                released += 1
                batch.release_req(
                    i,
                    len(batch.reqs) - released,
                    server_args,
                    keep_prefix=server_args.soft_priority_preemption,
                )
            else:
                keep.append(i)
        batch.filter_batch(keep_indices=keep)
        self.preempt_list.extend(victims)
        return True
