"""SchedulePolicy: the order of the waiting queue (SGLang's policies and priorities, then every
batch line after every interactive request), and the in-batch prefix trie. Which requests then fit is PrefillAdder's (prefill_adder.py)."""

from __future__ import annotations

import random
import sys
from collections import defaultdict
from collections.abc import Callable
from enum import Enum

from radixengine.managers.fair_policy import FairPolicy
from radixengine.managers.req import Req
from radixengine.mem_cache.base_prefix_cache import BasePrefixCache
from radixengine.mem_cache.radix_cache import TreeNode

# SGLang's constants (environment variables there).
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


def priority_sign(low_values_first: bool) -> int:
    """`priority * sign` ascending puts the most important first (the one place the
    `--schedule-low-priority-values-first` rule is written)."""
    return 1 if low_values_first else -1


def lowest_priority_value(low_values_first: bool) -> int:
    """The least important priority: what a request without one gets."""
    return sys.maxsize if low_values_first else -sys.maxsize - 1


def has_prefix_tree(tree_cache: BasePrefixCache) -> bool:
    """Whether the cache shares prefixes (a ChunkCache does not)."""
    return not tree_cache.disable


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
    still in flight) are about to compute. A compressed trie per radix namespace (`extra_key`: a
    LoRA adapter's KV is never another's); a node is {first token: [edge, children]}."""

    def __init__(self) -> None:
        self.roots: dict[str | None, dict[int, list]] = {}

    def reset(self) -> None:
        self.roots = {}

    def match(self, key: list[int], extra_key: str | None = None) -> int:
        node, i = self.roots.get(extra_key, {}), 0
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

    def insert(self, key: list[int], extra_key: str | None = None) -> None:
        node, i = self.roots.setdefault(extra_key, {}), 0
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
    """The order of the waiting queue. Cache-aware policies read each request's prefix match
    (`prefix_indices`, `last_node`): `match_and_order`, admission's one call a round, matches
    every waiting request first when the active policy reads them."""

    def __init__(
        self,
        policy: str,
        tree_cache: BasePrefixCache,
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
        self.priority_sign = priority_sign(schedule_low_priority_values_first)
        self.lpm_fallback_queue_len = lpm_fallback_queue_len
        self.enable_in_batch_prefix_caching = enable_in_batch_prefix_caching
        self.rng = rng or random.Random(0)
        self.fair = fair or FairPolicy()

    @staticmethod
    def _validate_and_adjust_policy(policy: str, tree_cache: BasePrefixCache) -> Policy:
        try:
            parsed: Policy = CacheAwarePolicy(policy)
        except ValueError:
            try:
                parsed = CacheAgnosticPolicy(policy)
            except ValueError:
                names = [p.value for p in (*CacheAgnosticPolicy, *CacheAwarePolicy)]
                raise ValueError(f"unknown schedule policy {policy!r}; one of {', '.join(names)}") from None
        if isinstance(parsed, CacheAwarePolicy) and not has_prefix_tree(tree_cache):
            return CacheAgnosticPolicy.FCFS  # no tree to be aware of
        return parsed

    def _determine_active_policy(self, waiting_queue: list[Req]) -> Policy:
        matching = (CacheAwarePolicy.LPM, CacheAwarePolicy.HRRN, CacheAwarePolicy.SHORTEST_PREFILL_FIRST)
        if self.policy in matching and len(waiting_queue) > self.lpm_fallback_queue_len:
            return CacheAgnosticPolicy.FCFS  # matching every request costs too much
        return self.policy

    def needs_prefix_match(self, waiting_queue: list[Req]) -> bool:
        """Whether this round's policy orders by prefix matches (then every waiting request is
        matched before it orders; otherwise admission matches each as it reaches it)."""
        return self._reads_prefixes(self._determine_active_policy(waiting_queue), waiting_queue)

    def _reads_prefixes(self, policy: Policy, waiting_queue: list[Req]) -> bool:
        return isinstance(policy, CacheAwarePolicy) and not self._dlpm_unmatched(policy, waiting_queue)

    def match_and_order(self, waiting_queue: list[Req], match_prefix: Callable[[Req], None]) -> bool:
        """Admission's one call per round: `match_prefix` every waiting request if this round's
        policy reads the matches, then sort the queue in place. Returns whether it matched."""
        policy = self._determine_active_policy(waiting_queue)
        matched = self._reads_prefixes(policy, waiting_queue)
        if matched:
            for req in waiting_queue:
                match_prefix(req)
        self._order(waiting_queue, policy)
        return matched

    def _dlpm_unmatched(self, policy: Policy, waiting_queue: list[Req]) -> bool:
        """dlpm past the fallback queue length: ordered by deficits alone, unmatched (as lpm falls
        back to fcfs)."""
        return policy == CacheAwarePolicy.DLPM and len(waiting_queue) > self.lpm_fallback_queue_len

    def calc_priority(self, waiting_queue: list[Req]) -> None:
        """Sort the waiting queue in place."""
        self._order(waiting_queue, self._determine_active_policy(waiting_queue))

    def _order(self, waiting_queue: list[Req], policy: Policy) -> None:
        if self.fair.handles(self.policy.value):  # the fair orders' clocks; the others need none
            self.fair.observe_queue(waiting_queue)
        if self._dlpm_unmatched(policy, waiting_queue):
            self.fair.sort("dlpm-unmatched", waiting_queue, set())  # too long to match: deficits only
        elif isinstance(policy, CacheAwarePolicy) and self.fair.handles(policy.value):
            self.fair.sort(policy.value, waiting_queue, self._deprioritized(waiting_queue))
        elif policy == CacheAwarePolicy.LPM:
            self._sort_by_longest_prefix(waiting_queue, self._deprioritized(waiting_queue))
        elif policy == CacheAwarePolicy.DFS_WEIGHT:
            self._sort_by_dfs_weight(waiting_queue, self.tree_cache)
        elif policy == CacheAgnosticPolicy.LOF:
            waiting_queue.sort(key=lambda r: -r.sampling_params.max_new_tokens)
        elif policy == CacheAgnosticPolicy.RANDOM:
            self.rng.shuffle(waiting_queue)
        if self.enable_priority_scheduling:
            self._sort_by_priority(waiting_queue, by_arrival=policy == CacheAgnosticPolicy.FCFS)
        if not all(r.interactive for r in waiting_queue):
            waiting_queue.sort(key=lambda r: not r.interactive)  # stable: batch lines last

    def _sort_by_priority(self, waiting_queue: list[Req], by_arrival: bool) -> None:
        """Stable: within a priority, the policy's order (FCFS: arrival)."""
        sign = self.priority_sign
        if by_arrival:
            waiting_queue.sort(key=lambda r: (r.priority * sign, r.time_stats.wait_queue_entry_time))
        else:
            waiting_queue.sort(key=lambda r: r.priority * sign)

    def _deprioritized(self, waiting_queue: list[Req]) -> set[Req]:
        """With in-batch prefix caching, a request with a short cached prefix that another
        waiting request shares by at least the threshold is deprioritized (it will hit the cache
        once that one has run)."""
        deprioritized: set[Req] = set()
        if not self.enable_in_batch_prefix_caching:
            return deprioritized
        trie = PrefixTrie()
        for req in waiting_queue:
            if len(req.prefix_indices) > IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD:
                continue
            prefix_ids = req.fill_ids[: req.max_prefix_len()]
            if trie.match(prefix_ids, req.extra_key) >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD:
                deprioritized.add(req)
            else:
                trie.insert(prefix_ids, req.extra_key)
        return deprioritized

    @staticmethod
    def _sort_by_longest_prefix(waiting_queue: list[Req], deprioritized: set[Req]) -> None:
        waiting_queue.sort(key=lambda r: float("inf") if r in deprioritized else -len(r.prefix_indices))

    @staticmethod
    def _sort_by_dfs_weight(waiting_queue: list[Req], tree_cache: BasePrefixCache) -> None:
        """Depth-first over the tree, heavier subtrees first; a node's own requests after its
        children (post-order). weight = waiting requests whose last node is in the subtree."""
        last_node_to_reqs: dict[TreeNode, list[Req]] = defaultdict(list)
        for req in waiting_queue:
            last_node_to_reqs[req.last_node].append(req)
        weight: dict[TreeNode, int] = defaultdict(int)
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


def _children(node: TreeNode) -> list[TreeNode]:
    return list(node.children.values())


def _calc_weight(root: TreeNode, weight: dict[TreeNode, int]) -> None:
    order: list[tuple[TreeNode, TreeNode | None]] = []
    stack: list[tuple[TreeNode, TreeNode | None]] = [(root, None)]
    while stack:  # iterative: trees can be deep
        node, parent = stack.pop()
        order.append((node, parent))
        stack.extend((c, node) for c in _children(node))
    for node, parent in reversed(order):  # children before parents
        if parent is not None:
            weight[parent] += weight[node]


def _get_dfs_priority(
    root: TreeNode, weight: dict[TreeNode, int], node_to_reqs: dict[TreeNode, list[Req]], out: list[Req]
) -> None:
    stack: list[tuple[TreeNode, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            out.extend(node_to_reqs.get(node, ()))
            continue
        stack.append((node, True))
        children = sorted((c for c in _children(node) if weight.get(c, 0) > 0), key=lambda c: -weight[c])
        stack.extend((c, False) for c in reversed(children))
