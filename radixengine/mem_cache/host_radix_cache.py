"""HostRadixCache: the radix cache over a host tier (SGLang's HiRadixCache, host part).

A node is on the device (`value`), on the host (`host_value`), or both. Eviction from the device
keeps a node in the tree: its KV is copied to the host pool first unless it already is there
(write_back backs up only then; write_through backs up every node of a finished request's path,
write_through_selective those at least `WRITE_THROUGH_SELECTIVE_HITS` requests used), and only
its device slots are freed. The host pool, when full, evicts its own leaves (nodes on the host
only, least recently used first); a node that finds no host room is deleted as before.

The device invariant holds as in the radix cache: a node on the device has all its ancestors on
the device, `evictable + protected` count device tokens only, and matching stops at the first
node on the host only. `load_back` (admission, via `load_from_storage`) copies the host nodes
that continue a request's match back into freshly allocated device slots, so the request's next
match is longer; the nodes keep their host copy. A load in flight (a write stream that has not
run it yet) host-locks its nodes: host eviction skips them until the copy is done.
The host accounting: host pool free slots + every node's host slots == host pool size.
"""

from __future__ import annotations

import heapq
import logging
from typing import TYPE_CHECKING

import torch

from radixengine.mem_cache.base_prefix_cache import CacheReq, PoolWriteStream, as_token_key, finished_kv_len
from radixengine.mem_cache.hicache_transfer import HostTransfer, InlineHostTransfer, TransferAck
from radixengine.mem_cache.memory_pool_host import HostKVPool
from radixengine.mem_cache.radix_cache import RadixCache, TreeNode, req_extra_key
from radixengine.mem_cache.storage.policies import HICACHE_WRITE_POLICIES

if TYPE_CHECKING:
    from radixengine.mem_cache.allocator import BaseTokenToKVPoolAllocator
    from radixengine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

logger = logging.getLogger(__name__)

WRITE_THROUGH_SELECTIVE_HITS = 2


class HostRadixCache(RadixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool | None,
        token_to_kv_pool_allocator: BaseTokenToKVPoolAllocator | None,
        page_size: int,
        eviction_policy: str = "lru",
        evict_leaf_tails: bool = False,
        host_pool: HostKVPool | None = None,
        host_transfer: HostTransfer | None = None,
        write_policy: str = "write_through",
    ) -> None:
        if write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(
                f"hicache write policy {write_policy!r}; one of {', '.join(HICACHE_WRITE_POLICIES)}"
            )
        self.host_pool = host_pool
        self.transfer = host_transfer or InlineHostTransfer()
        self.write_policy = write_policy
        self._loads_in_flight: list[tuple[TransferAck, list[TreeNode]]] = []
        self.host_tokens_written = 0  # tokens backed up from the device to the host pool
        self.host_tokens_loaded = 0  # tokens loaded back from the host pool
        self.host_tokens_evicted = 0  # tokens the host pool evicted
        # Where KV is written into the pool: inline, or (overlap loop) on the forward stream.
        self.pool_write_stream: PoolWriteStream | None = None
        super().__init__(
            req_to_token_pool, token_to_kv_pool_allocator, page_size, eviction_policy, evict_leaf_tails
        )

    def reset(self) -> None:
        for ack, _ in getattr(self, "_loads_in_flight", ()):
            ack.wait()
        self._loads_in_flight = []
        super().reset()
        if self.host_pool is not None:
            self.host_pool.clear()

    def set_pool_write_stream(self, stream: PoolWriteStream) -> None:
        self.pool_write_stream = stream

    @property
    def kv_pool(self) -> MHATokenToKVPool:
        return self.token_to_kv_pool_allocator.get_kvcache()

    # ---- device eviction: to the host ----

    def _is_leaf(self, node: TreeNode) -> bool:
        if self.host_pool is None:
            return not node.children
        return all(child.value is None for child in node.children.values())

    def _evict_leaf(self, node: TreeNode) -> torch.Tensor:
        if self.host_pool is None or (node.host_value is None and not self._backup(node)):
            self._drop_host_children(node)
            return super()._evict_leaf(node)
        value, node.value = node.value, None
        self.evictable_size_ -= len(node.key)
        self._evictable_leaves.discard(node)
        parent = node.parent
        if parent.lock_ref == 0 and self._is_leaf(parent):
            self._mark_evictable(parent)
        return value

    def _backup(self, node: TreeNode) -> bool:
        """Copy a device node to the host pool; False if the host pool has no room for it."""
        host_slots = self._host_alloc(len(node.value))
        if host_slots is None:
            return False
        self.transfer.backup(self.kv_pool, node.value, self.host_pool, host_slots)
        node.host_value = host_slots
        self.host_tokens_written += len(host_slots)
        return True

    def _drop_host_children(self, node: TreeNode) -> None:
        """Before a device node is deleted: delete the subtree on the host only below it."""
        self._release_done_loads()
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            stack.extend(child.children.values())
            if child.host_lock_ref:
                for ack, _ in self._loads_in_flight:
                    ack.wait()
                self._release_done_loads()
            self.host_pool.free(child.host_value)
            self.host_tokens_evicted += len(child.host_value)
            child.host_value, child.parent = None, None
        node.children.clear()

    def _revive(self, node: TreeNode, value: torch.Tensor) -> None:
        """A request recomputed a node that is on the host only: its slots are the device copy."""
        node.value = value.to(torch.int64, copy=True)
        self.evictable_size_ += len(node.key)
        self._evictable_leaves.discard(node.parent)
        if node.lock_ref == 0 and self._is_leaf(node):
            self._mark_evictable(node)

    # ---- the host pool's own eviction ----

    def _host_alloc(self, num: int) -> torch.Tensor | None:
        if self.host_pool.available_size() < num:
            self.evict_host(num - self.host_pool.available_size())
        return self.host_pool.alloc(num)

    def evict_host(self, num_tokens: int) -> int:
        """Delete nodes on the host only (leaves first, least recently used first, none with a
        copy in flight) until `num_tokens` host slots are freed; returns how many were."""
        self._release_done_loads()
        heap = [(n.last_access_time, n.id, n) for n in self._iter_nodes() if self._host_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[self._node_key(node)]
            node.parent = None
            self.host_pool.free(node.host_value)
            freed += len(node.host_value)
            node.host_value = None
            if parent is not self.root_node and self._host_evictable(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        self.host_tokens_evicted += freed
        return freed

    @staticmethod
    def _host_evictable(node: TreeNode) -> bool:
        return node.value is None and not node.children and node.host_lock_ref == 0

    def _release_done_loads(self) -> None:
        still = []
        for ack, nodes in self._loads_in_flight:
            if not ack.done():
                still.append((ack, nodes))
                continue
            for node in nodes:
                node.host_lock_ref -= 1
        self._loads_in_flight = still

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        upper = super()._split_node(child, split_len)
        if child.host_lock_ref:  # both halves stay locked until the load in flight is done
            for _, nodes in self._loads_in_flight:
                if any(n is child for n in nodes):
                    nodes.append(upper)
        return upper

    # ---- loading back ----

    def load_from_storage(self, req: CacheReq, key: list[int] | tuple[int, ...]) -> int:
        """Admission's hook: load the host nodes that continue `key`'s device match back (in the
        request's namespace)."""
        loaded = self.load_back(key, req_extra_key(req))
        if loaded and not getattr(req, "retracted_stain", False):
            req.host_hit_tokens = getattr(req, "host_hit_tokens", 0) + loaded
        return loaded

    def load_back(self, key: list[int] | tuple[int, ...], extra_key: str | None = None) -> int:
        """Copy the nodes on the host only that continue the device match of `key` in namespace
        `extra_key` into device slots (evicting on the device if needed); returns how many
        tokens came back."""
        if self.host_pool is None:
            return 0
        self._release_done_loads()
        tokens = self._page_aligned(as_token_key(key))
        values, node = self._match_prefix_helper(tokens, extra_key) if tokens else ([], self.root_node)
        host_nodes = self._host_path(node, tokens, sum(len(v) for v in values), extra_key)
        if not host_nodes:
            return 0
        for n in host_nodes:
            n.host_lock_ref += 1  # the device eviction below may move nodes to the host
        num = sum(len(n.key) for n in host_nodes)
        slots = self._alloc_protecting(node, num)
        if slots is None:
            for n in host_nodes:
                n.host_lock_ref -= 1
            return 0
        host_slots = torch.cat([n.host_value for n in host_nodes])
        ack = self.transfer.load(self.host_pool, host_slots, self.kv_pool, slots, self.pool_write_stream)
        self._loads_in_flight.append((ack, host_nodes))
        self._attach(node, host_nodes, slots)
        self.host_tokens_loaded += num
        return num

    def _host_path(
        self, node: TreeNode, tokens: tuple[int, ...], matched: int, extra_key: str | None
    ) -> list[TreeNode]:
        """The nodes on the host only that continue the match at `node` (the last one split at
        the end of `tokens`)."""
        path, i, now = [], matched, self._tick()
        while i < len(tokens):
            child = node.children.get(self._child_key(tokens, i, extra_key))
            if child is None or child.value is not None or child.host_value is None:
                break
            length = self._match_len(child.key, tokens, i)
            if length == 0:
                break
            if length < len(child.key):
                child = self._split_node(child, length)
            child.last_access_time = now
            path.append(child)
            node, i = child, i + length
        return path

    def _attach(self, parent: TreeNode, host_nodes: list[TreeNode], slots: torch.Tensor) -> None:
        """The loaded nodes are on the device (and still on the host) now."""
        at = 0
        for n in host_nodes:
            n.value = slots[at : at + len(n.key)].clone()
            at += len(n.key)
            self.evictable_size_ += len(n.key)
        self._evictable_leaves.discard(parent)
        last = host_nodes[-1]
        if self._is_leaf(last):
            self._mark_evictable(last)

    def _alloc_protecting(self, node: TreeNode, num: int) -> torch.Tensor | None:
        allocator = self.token_to_kv_pool_allocator
        self.inc_lock_ref(node)
        try:
            if allocator.available_size() < num:
                self.evict(num - allocator.available_size())
            return allocator.alloc(num) if allocator.available_size() >= num else None
        finally:
            self.dec_lock_ref(node)

    # ---- write through ----

    def cache_finished_req(self, req: CacheReq, is_insert: bool = True) -> None:
        tokens = None
        if self.host_pool is not None and is_insert and self.write_policy != "write_back":
            tokens = tuple((list(req.origin_input_ids) + list(req.output_ids))[: finished_kv_len(req)])
        super().cache_finished_req(req, is_insert)
        if tokens:
            self._write_through(self._page_aligned(tokens), req_extra_key(req))

    def _write_through(self, tokens: tuple[int, ...], extra_key: str | None = None) -> None:
        """Back up the device nodes of `tokens`'s path (in namespace `extra_key`) that have no
        host copy yet."""
        node, i = self.root_node, 0
        while i < len(tokens):
            child = node.children.get(self._child_key(tokens, i, extra_key))
            if child is None or child.value is None or self._match_len(child.key, tokens, i) < len(child.key):
                return
            selective = self.write_policy == "write_through_selective"
            if child.host_value is None and (
                not selective or child.hit_count >= WRITE_THROUGH_SELECTIVE_HITS
            ):
                if not self._backup(child):
                    return
            node, i = child, i + len(child.key)

    # ---- accounting and stats ----

    def tier_accounting_problem(self) -> str | None:
        if self.host_pool is None:
            return None
        held, orphans = 0, 0
        for n in self._iter_nodes():
            held += 0 if n.host_value is None else len(n.host_value)
            orphans += n.value is None and n.host_value is None
        available, size = self.host_pool.available_size(), self.host_pool.size
        problems = []
        if available + held != size:
            problems.append(
                f"host slots: available {available} + held by nodes {held} != host pool size {size}"
            )
        if orphans:
            problems.append(f"{orphans} nodes are neither on the device nor on the host")
        return "; ".join(problems) or None

    def tier_stats(self) -> dict[str, int]:
        if self.host_pool is None:
            return {}
        return {
            "host_pool_size": self.host_pool.size,
            "host_pool_used_tokens": self.host_pool.size - self.host_pool.available_size(),
            "host_tokens_written": self.host_tokens_written,
            "host_tokens_loaded": self.host_tokens_loaded,
            "host_tokens_evicted": self.host_tokens_evicted,
            "host_loads_in_flight": sum(not ack.done() for ack, _ in self._loads_in_flight),
        }
