"""RadixCache: a radix tree of token ids whose nodes hold the KV slots of their edge.

With page_size > 1 the tree works in whole pages: keys are truncated to a multiple of the page
size, a child is keyed by the tuple of its first page, and matches advance a page at a time.

Eviction frees whole leaves, as SGLang's does; with `evict_leaf_tails` it frees only the pages a
leaf's tail needs to give (the leaf is split, its head stays cached with the same eviction key):
a prefix's KV does not depend on the tokens after it, so the head stays valid. Soft priority
preemption turns it on, so that a victim released into the cache loses only what the
preempting request takes from it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from radixengine.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    CacheReq,
    MatchResult,
    as_token_key,
    finished_kv_len,
    req_kv_indices,
)
from radixengine.mem_cache.evict_policy import EvictionKey, get_eviction_strategy
from radixengine.mem_cache.memory_pool import check_count

if TYPE_CHECKING:
    from radixengine.mem_cache.allocator import BaseTokenToKVPoolAllocator
    from radixengine.mem_cache.memory_pool import ReqToTokenPool

_node_ids = itertools.count()

# A child's key in its parent: its first token (page_size 1) or its first page, paired with the
# node's extra key when it has one.
ChildKey = int | tuple[int, ...] | tuple[str, int | tuple[int, ...]]

# Matching compares this many tokens per slice before looking for the first difference.
_SCAN_BLOCK = 64


@dataclass(eq=False, slots=True)
class TreeNode:
    key: tuple[int, ...] = ()
    value: torch.Tensor | None = None
    parent: TreeNode | None = None
    children: dict[ChildKey, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    # A logical clock (one tick per match/insert): the LRU order of SGLang's wall-clock times,
    # without ties.
    last_access_time: int = 0
    hit_count: int = 0  # distinct requests that inserted through the node (lfu, slru)
    priority: int = 0  # the highest priority of the requests that inserted it (priority eviction)
    # The host tier (host_radix_cache.py): the node's slots in the host pool, if it has a copy
    # there; `value` is None once the device copy is evicted (the node is on the host only).
    host_value: torch.Tensor | None = None
    host_lock_ref: int = 0  # copies from the host slots in flight
    # The namespace of the node's path (SGLang's RadixKey.extra_key: a LoRA adapter's id); None
    # is the base model's. A child's key in its parent includes it, so namespaces never meet.
    extra_key: str | None = None
    id: int = field(default_factory=lambda: next(_node_ids))

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access_time < other.last_access_time

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, children={len(self.children)})"


def _common_prefix_len(stored: tuple[int, ...], key: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of `stored` and `key[start:]`."""
    limit = min(len(stored), len(key) - start)
    if key[start : start + limit] == stored[:limit]:
        return limit
    i = 0
    while (
        i + _SCAN_BLOCK <= limit and key[start + i : start + i + _SCAN_BLOCK] == stored[i : i + _SCAN_BLOCK]
    ):
        i += _SCAN_BLOCK
    while stored[i] == key[start + i]:
        i += 1
    return i


class RadixCache(BasePrefixCache):
    disable: ClassVar[bool] = False

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool | None,
        token_to_kv_pool_allocator: BaseTokenToKVPoolAllocator | None,
        page_size: int = 1,
        eviction_policy: str = "lru",
        evict_leaf_tails: bool = False,
    ):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = check_count("page_size", page_size, 1)
        self.eviction_strategy = get_eviction_strategy(eviction_policy)
        self.evict_leaf_tails = evict_leaf_tails
        self.device = getattr(token_to_kv_pool_allocator, "device", "cpu")
        self.reset()

    def reset(self) -> None:
        self.root_node = TreeNode(value=self._empty())
        self.root_node.lock_ref = 1
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self._clock = 0
        # Unlocked leaves, and a heap of (eviction key, id, node) over them whose entries may be
        # stale: evict() skips or refreshes those.
        self._evictable_leaves: set[TreeNode] = set()
        self._leaf_heap: list[tuple[EvictionKey, int, TreeNode]] = []

    # ---- lookups ----

    def match_prefix(self, key: list[int] | tuple[int, ...], extra_key: str | None = None) -> MatchResult:
        key = self._page_aligned(as_token_key(key))
        if not key:
            return MatchResult(self._empty(), self.root_node)
        values, node = self._match_prefix_helper(key, extra_key)
        indices = torch.cat(values) if values else self._empty()
        return MatchResult(indices, node)

    def _match_prefix_helper(
        self, key: tuple[int, ...], extra_key: str | None = None
    ) -> tuple[list[torch.Tensor], TreeNode]:
        now = self._tick()
        node, values, i = self.root_node, [], 0
        node.last_access_time = now
        while i < len(key):
            child = node.children.get(self._child_key(key, i, extra_key))
            if child is None or child.value is None:  # not cached, or on the host only
                break
            matched = self._match_len(child.key, key, i)
            if matched < len(child.key):
                node = self._split_node(child, matched)
                node.last_access_time = now
                values.append(node.value)
                break
            child.last_access_time = now
            values.append(child.value)
            node, i = child, i + matched
        return values, node

    def insert(
        self,
        key: list[int] | tuple[int, ...],
        value: torch.Tensor | None = None,
        priority: int = 0,
        counted_len: int = 0,
        extra_key: str | None = None,
    ) -> int:
        """Insert `key`; returns how many of its tokens were already in the tree. `priority` and
        the hits feed the eviction policy: each node on the path that reaches past `counted_len`
        (the tokens the same request inserted before: a chunk, its prompt after the prefill, a
        preemption) counts one more request."""
        key_tokens = as_token_key(key)
        if value is None:
            value = torch.tensor(key_tokens, dtype=torch.int64, device=self.device)
        if len(value) != len(key_tokens):
            raise ValueError(f"insert: value has {len(value)} slots for {len(key_tokens)} tokens")
        aligned = self._page_aligned(key_tokens)
        return self._insert_helper(
            aligned,
            value if len(aligned) == len(key_tokens) else value[: len(aligned)],
            priority,
            counted_len,
            extra_key,
        )

    def _insert_helper(
        self,
        key: tuple[int, ...],
        value: torch.Tensor,
        priority: int,
        counted_len: int,
        extra_key: str | None = None,
    ) -> int:
        now = self._tick()
        node, i = self.root_node, 0
        present = -1  # where the path leaves the device (a node on the host only), if it does
        node.last_access_time = now
        while i < len(key):
            child = node.children.get(self._child_key(key, i, extra_key))
            if child is None:
                break
            matched = self._match_len(child.key, key, i)
            if matched < len(child.key):
                child = self._split_node(child, matched)
            child.last_access_time = now
            _record_insert(child, priority, i + matched > counted_len)
            if child.value is None:  # on the host only: the new slots are its device copy again
                present = i if present < 0 else present
                self._revive(child, value[i : i + matched])
            node, i = child, i + matched
        if i < len(key):
            self._add_leaf(node, key[i:], value[i:], now, priority, int(len(key) > counted_len), extra_key)
        return i if present < 0 else present

    def _revive(self, node: TreeNode, value: torch.Tensor) -> None:
        """Give a node on the host only its device slots again (the host tier overrides it)."""
        raise RuntimeError(f"node {node.id} has no device slots and this cache has no host tier")

    # ---- tree surgery ----

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut `child`'s edge after `split_len` tokens; returns the new upper node."""
        parent = child.parent
        upper = TreeNode(
            key=child.key[:split_len],
            value=_head(child.value, split_len),
            parent=parent,
            lock_ref=child.lock_ref,
            last_access_time=child.last_access_time,
            hit_count=child.hit_count,
            priority=child.priority,
            host_value=_head(child.host_value, split_len),
            host_lock_ref=child.host_lock_ref,
            extra_key=child.extra_key,
        )
        child.key = child.key[split_len:]
        child.value = _tail(child.value, split_len)
        child.host_value = _tail(child.host_value, split_len)
        child.parent = upper
        upper.children[self._node_key(child)] = child
        parent.children[self._node_key(upper)] = upper
        return upper

    def _add_leaf(
        self,
        parent: TreeNode,
        key: tuple[int, ...],
        value: torch.Tensor,
        now: int,
        priority: int,
        hit_count: int,
        extra_key: str | None = None,
    ) -> None:
        owned = value.clone() if value.dtype == torch.int64 else value.to(torch.int64)
        leaf = TreeNode(
            key=key,
            value=owned,
            parent=parent,
            last_access_time=now,
            hit_count=hit_count,
            priority=priority,
            extra_key=extra_key,
        )
        self._evictable_leaves.discard(parent)
        parent.children[self._node_key(leaf)] = leaf
        self.evictable_size_ += len(key)
        self._mark_evictable(leaf)

    def _delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        del parent.children[self._node_key(node)]
        node.parent = None
        self.evictable_size_ -= len(node.key)
        self._evictable_leaves.discard(node)
        if parent.lock_ref == 0 and self._is_leaf(parent):
            self._mark_evictable(parent)

    def _is_leaf(self, node: TreeNode) -> bool:
        """No child holds device slots (the host tier keeps children on the host only)."""
        return not node.children

    def _mark_evictable(self, node: TreeNode) -> None:
        self._evictable_leaves.add(node)
        heapq.heappush(self._leaf_heap, (self.eviction_strategy.get_priority(node), node.id, node))
        if len(self._leaf_heap) > 4 * len(self._evictable_leaves) + 1024:
            self._leaf_heap = [
                (self.eviction_strategy.get_priority(n), n.id, n) for n in self._evictable_leaves
            ]
            heapq.heapify(self._leaf_heap)

    # ---- eviction and locks ----

    def evict(self, num_tokens: int) -> int:
        num_tokens = check_count("num_tokens", num_tokens)
        freed: list[torch.Tensor] = []
        evicted = 0
        while evicted < num_tokens and self._leaf_heap:
            evict_key, _, node = heapq.heappop(self._leaf_heap)
            if node not in self._evictable_leaves:
                continue
            current = self.eviction_strategy.get_priority(node)
            if evict_key != current:  # keys only grow: the entry is stale, the node goes later
                heapq.heappush(self._leaf_heap, (current, node.id, node))
                continue
            node = self._tail_to_evict(node, num_tokens - evicted)
            evicted += len(node.key)
            freed.append(self._evict_leaf(node))
        if freed:
            self.token_to_kv_pool_allocator.free(torch.cat(freed))
        return evicted

    def _evict_leaf(self, node: TreeNode) -> torch.Tensor:
        """Take an unlocked leaf's device slots out of the tree; returns them (to be freed)."""
        value = node.value
        self._delete_leaf(node)
        return value

    def _tail_to_evict(self, leaf: TreeNode, num_tokens: int) -> TreeNode:
        """The part of `leaf` to evict for `num_tokens`: all of it, or with `evict_leaf_tails`
        its last pages, split off (the head keeps the leaf's place in the evictable set)."""
        keep = (len(leaf.key) - num_tokens) // self.page_size * self.page_size
        if not self.evict_leaf_tails or keep <= 0:
            return leaf
        self._split_node(leaf, keep)
        return leaf

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        if node is None:
            return 0
        delta = 0
        for path_node in self._path_to_root(node):
            if path_node.lock_ref == 0:
                self.evictable_size_ -= len(path_node.key)
                self.protected_size_ += len(path_node.key)
                delta -= len(path_node.key)
                self._evictable_leaves.discard(path_node)
            path_node.lock_ref += 1
        return delta

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        if node is None:
            return 0
        path = self._path_to_root(node)
        if path and node.lock_ref <= 0:
            raise RuntimeError(f"dec_lock_ref: node {node.id} is not locked (lock_ref {node.lock_ref})")
        delta = 0
        for path_node in path:
            if path_node.lock_ref == 1:
                self.evictable_size_ += len(path_node.key)
                self.protected_size_ -= len(path_node.key)
                delta += len(path_node.key)
                if self._is_leaf(path_node):
                    self._mark_evictable(path_node)
            path_node.lock_ref -= 1
        return delta

    def _path_to_root(self, node: TreeNode) -> list[TreeNode]:
        """The nodes from `node` up to, not including, the root; raises if `node` is not in the tree."""
        path = []
        while node is not self.root_node:
            if node.parent is None:
                raise ValueError(f"node {node.id} is not in this tree (evicted, or from before a reset)")
            path.append(node)
            node = node.parent
        return path

    # ---- sizes ----

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def total_size(self) -> int:
        return sum(len(node.key) for node in self._iter_nodes() if node.value is not None)

    def _iter_nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def pretty_print(self) -> None:
        print(self._format_tree())

    def _format_tree(self) -> str:
        lines: list[str] = []
        stack = [(child, 0) for child in self.root_node.children.values()]
        while stack:
            node, depth = stack.pop()
            head = list(node.key[:10])
            more = "..." if len(node.key) > 10 else ""
            lines.append(f"{'  ' * depth}{len(node.key)} {head}{more} lock_ref={node.lock_ref}")
            stack.extend((child, depth + 1) for child in node.children.values())
        lines.append(
            f"#tokens: {self.total_size()} (evictable {self.evictable_size_}, protected {self.protected_size_})"
        )
        return "\n".join(lines)

    # ---- requests ----

    def cache_finished_req(self, req: CacheReq, is_insert: bool = True) -> None:
        all_len = finished_kv_len(req)
        token_ids = (list(req.origin_input_ids) + list(req.output_ids))[:all_len]
        kv = req_kv_indices(self.req_to_token_pool, req, all_len)
        aligned = all_len // self.page_size * self.page_size
        owned = self._tree_owned_len(req)
        allocator = self.token_to_kv_pool_allocator
        if is_insert:
            new_prefix_len = self._insert_req(req, token_ids[:aligned], kv[:aligned])
            allocator.free(kv[owned:new_prefix_len])
        else:
            allocator.free(kv[owned:aligned])
        allocator.free(kv[aligned:])
        self.req_to_token_pool.free(req.req_pool_idx)
        self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: CacheReq) -> None:
        token_ids = list(req.fill_ids)
        kv = req_kv_indices(self.req_to_token_pool, req, len(token_ids))
        aligned = len(token_ids) // self.page_size * self.page_size
        owned = self._tree_owned_len(req)
        new_prefix_len = self._insert_req(req, token_ids[:aligned], kv[:aligned])
        self.token_to_kv_pool_allocator.free(kv[owned:new_prefix_len])

        new_indices, new_last_node = self.match_prefix(token_ids[:aligned], req_extra_key(req))
        if len(new_indices) != aligned:
            raise RuntimeError(
                f"cache_unfinished_req: matched {len(new_indices)} of {aligned} just-inserted tokens"
            )
        # Point the row at the tree's slots: the duplicates freed above may be handed out again.
        self.req_to_token_pool.write((req.req_pool_idx, slice(owned, aligned)), new_indices[owned:])
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(new_last_node)
        if self.page_size > 1:
            new_indices = torch.cat((new_indices, kv[aligned:]))
        req.prefix_indices = new_indices
        req.last_node = new_last_node

    def _insert_req(self, req: CacheReq, token_ids: list[int], kv: torch.Tensor) -> int:
        """Insert a request's tokens: its hit on a node counts once, whatever it inserts again."""
        present = self.insert(token_ids, kv, _req_priority(req), req.hit_counted_len, req_extra_key(req))
        req.hit_counted_len = max(req.hit_counted_len, len(token_ids))
        return present

    def _tree_owned_len(self, req: CacheReq) -> int:
        # With pages, prefix_indices may end in the request's own partial page; the tree owns only
        # the whole pages before it.
        return len(req.prefix_indices) // self.page_size * self.page_size

    # ---- helpers ----

    def _child_key(self, key: tuple[int, ...], start: int, extra_key: str | None = None) -> ChildKey:
        child = key[start] if self.page_size == 1 else key[start : start + self.page_size]
        return child if extra_key is None else (extra_key, child)

    def _node_key(self, node: TreeNode) -> ChildKey:
        """`node`'s key in its parent's children."""
        return self._child_key(node.key, 0, node.extra_key)

    def _match_len(self, stored: tuple[int, ...], key: tuple[int, ...], start: int) -> int:
        matched = _common_prefix_len(stored, key, start)
        return matched if self.page_size == 1 else matched // self.page_size * self.page_size

    def _page_aligned(self, key: tuple[int, ...]) -> tuple[int, ...]:
        if self.page_size == 1:
            return key
        return key[: len(key) // self.page_size * self.page_size]

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _empty(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64, device=self.device)


def _head(slots: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if slots is None else slots[:n].clone()


def _tail(slots: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if slots is None else slots[n:].clone()


def _record_insert(node: TreeNode, priority: int, hit: bool) -> None:
    if hit:
        node.hit_count += 1
    node.priority = max(node.priority, priority)


def _req_priority(req: CacheReq) -> int:
    return getattr(req, "priority", None) or 0


def req_extra_key(req: CacheReq) -> str | None:
    """The radix namespace of a request's KV (its LoRA adapter's id; None: the base model)."""
    return getattr(req, "extra_key", None)
