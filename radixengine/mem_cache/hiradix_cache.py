"""HiRadixCache: the radix cache backed by a storage tier (SGLang's HiRadixCache, storage part),
over the host tier of HostRadixCache when it has a host pool.

Pages of the tree's prefixes are written to storage by the write policy, keyed by a hash chain
of their tokens (storage/base.py): `write_through` when a request finishes (every page of its
path not stored yet), `write_through_selective` the same for pages whose node at least
`WRITE_THROUGH_SELECTIVE_HITS` requests went through (SGLang's threshold), `write_back` when
eviction frees a node. A page is copied out of the pool on the scheduler's thread (a memcpy) and
written by a background thread.

Reading back: `prefetch_from_storage`, called when a request enters the waiting queue (as
SGLang's scheduler does), starts a prefetch of the pages that follow what the tree holds (a
background thread reads them into host memory); `load_from_storage`, called by admission right
before a request is offered to the batch, first loads the host tier's nodes back
(host_radix_cache.py), then waits for the prefetch as the prefetch policy says, allocates pool
slots (evicting in the tree if needed), copies the pages in and inserts them in the tree, so the
request's next match is longer: device, then host, then storage. A loaded page is in the tree before the call returns: no
pool slot is ever in flight between tiers, so the token-accounting invariant is the radix
cache's. Storage pages are `page_tokens` long (a multiple of the pool's page size); a match that
ends inside one uses its tail.

Under tensor parallelism each rank stores its own heads' pages (its own identity: a subfolder of
its own) and reads them in its own time; the ranks' schedulers must still make the same choices,
so each choice that depends on what arrived (may a request be admitted, how many pages it loads)
is the least of the ranks' (`ranks_min`, a collective over the CPU group), every call on every rank.

Every walk, load and page key is in the request's radix namespace (`extra_key`, a LoRA
adapter's id): an adapter's page key chain starts from its namespace's seed (a digest of the
adapter's weights: storage/namespaces.py), the base model's from nothing, as before namespaces.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixengine.mem_cache.base_prefix_cache import CacheReq, as_token_key, finished_kv_len
from radixengine.mem_cache.hicache_transfer import HostTransfer, gather_device, scatter_device
from radixengine.mem_cache.host_radix_cache import WRITE_THROUGH_SELECTIVE_HITS, HostRadixCache
from radixengine.mem_cache.memory_pool_host import HostKVPool
from radixengine.mem_cache.radix_cache import TreeNode, req_extra_key
from radixengine.mem_cache.storage.base import HiCacheStorage, page_keys
from radixengine.mem_cache.storage.io_threads import PrefetchOp, StoragePrefetcher, StorageWriter
from radixengine.mem_cache.storage.namespaces import NamespaceSeeds
from radixengine.mem_cache.storage.policies import HICACHE_PREFETCH_POLICIES, HICACHE_WRITE_POLICIES

if TYPE_CHECKING:
    from radixengine.mem_cache.allocator import BaseTokenToKVPoolAllocator
    from radixengine.mem_cache.memory_pool import ReqToTokenPool

logger = logging.getLogger(__name__)

WRITE_POLICIES = HICACHE_WRITE_POLICIES
PREFETCH_POLICIES = HICACHE_PREFETCH_POLICIES
DEFAULT_PREFETCH_TIMEOUT_S = 2.0  # SGLang's prefetch_timeout_base is 1 s
DEFAULT_PREFETCH_TIMEOUT_PER_KI_TOKEN_S = 0.25  # SGLang's prefetch_timeout_per_ki_token
DEFAULT_MAX_PREFETCH_BYTES = 1 << 30  # pages read ahead and not loaded yet, all requests together
STORAGE_PAGE_TOKENS = 16  # rounded up to a multiple of the pool's page size


def storage_page_tokens(page_size: int) -> int:
    return -(-STORAGE_PAGE_TOKENS // page_size) * page_size


@dataclass(frozen=True)
class PrefetchConfig:
    """How admission waits for a request's storage prefetch, and the memory prefetches hold."""

    policy: str = "best_effort"
    timeout_s: float = DEFAULT_PREFETCH_TIMEOUT_S  # timeout: the wait; wait_complete: the stall
    timeout_per_ki_token_s: float = DEFAULT_PREFETCH_TIMEOUT_PER_KI_TOKEN_S  # added per 1024 tokens
    max_bytes: int = DEFAULT_MAX_PREFETCH_BYTES

    def __post_init__(self) -> None:
        if self.policy not in PREFETCH_POLICIES:
            raise ValueError(
                f"hicache prefetch policy {self.policy!r}; one of {', '.join(PREFETCH_POLICIES)}"
            )


class HiRadixCache(HostRadixCache):
    """`ranks_min`: the least of a value over the tensor-parallel ranks (one rank: the value)."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool | None,
        token_to_kv_pool_allocator: BaseTokenToKVPoolAllocator | None,
        page_size: int,
        storage: HiCacheStorage,
        eviction_policy: str = "lru",
        evict_leaf_tails: bool = False,
        write_policy: str = "write_through",
        prefetch: PrefetchConfig = PrefetchConfig(),
        max_pending_write_bytes: int = 256 << 20,
        host_pool: HostKVPool | None = None,
        host_transfer: HostTransfer | None = None,
        ranks_min: Callable[[int], int] = lambda value: value,
    ) -> None:
        super().__init__(
            req_to_token_pool,
            token_to_kv_pool_allocator,
            page_size,
            eviction_policy,
            evict_leaf_tails,
            host_pool,
            host_transfer,
            write_policy,
        )
        self.storage = storage
        self.ranks_min = ranks_min
        self.page_tokens = storage.identity.page_tokens
        if self.page_tokens % page_size:
            raise ValueError(f"storage pages of {self.page_tokens} tokens with pool pages of {page_size}")
        self.prefetch_policy = prefetch.policy
        self.prefetch_timeout_s = prefetch.timeout_s
        self.prefetch_timeout_per_ki_token_s = prefetch.timeout_per_ki_token_s
        self.writer = StorageWriter(storage, max_pending_write_bytes)
        self.prefetcher = StoragePrefetcher(storage, prefetch.max_bytes, storage.identity.page_bytes())
        self.namespaces = NamespaceSeeds()
        self._stored: set[str] = set()  # keys this cache wrote or read (known to be in storage)
        self._touched: dict[str, int] = {}  # key -> pages submitted when its recency was refreshed
        self.storage_hit_tokens = 0  # tokens loaded from storage into the pool
        self.storage_pages_loaded = 0

    # ---- page keys ----

    def _page_keys(self, tokens: tuple[int, ...], num_pages: int, extra_key: str | None) -> list[str]:
        """The storage keys of the first `num_pages` pages of `tokens` in namespace `extra_key`
        (every key is made here)."""
        return page_keys(tokens, self.page_tokens, num_pages, self.namespaces.seed(extra_key))

    def set_namespace_digests(self, digest_of: Callable[[str], bytes | None]) -> None:
        self.namespaces.set_digests(digest_of)

    # ---- reading back ----

    def prefetch_from_storage(
        self, rid: str, key: list[int] | tuple[int, ...], extra_key: str | None = None
    ) -> None:
        """Request `rid` was queued: start reading the pages of `key` in namespace `extra_key`
        that neither the device nor the host holds (without touching the tree). The prefetch is
        the request's own."""
        tokens = self._page_aligned(as_token_key(key))
        self.prefetcher.release(rid)
        first = self._held_len(tokens, extra_key) // self.page_tokens
        num_pages = len(tokens) // self.page_tokens
        if first >= num_pages:
            return
        keys = self._page_keys(tokens, num_pages, extra_key)[first:]
        pts = self.page_tokens
        chunks = [tokens[(first + i) * pts : (first + i + 1) * pts] for i in range(len(keys))]
        self.prefetcher.request(rid, first, keys, chunks)

    def _held_len(self, tokens: tuple[int, ...], extra_key: str | None) -> int:
        """How much of `tokens` the tree holds in namespace `extra_key`, on the device or the host."""
        node, i = self.root_node, 0
        while i < len(tokens):
            child = node.children.get(self._child_key(tokens, i, extra_key))
            matched = 0 if child is None else self._match_len(child.key, tokens, i)
            i += matched
            if matched == 0 or matched < len(child.key):
                break
            node = child
        return i

    def check_prefetch_progress(self, rid: str) -> bool:
        """Whether request `rid` may be admitted now (SGLang's check_prefetch_progress), on every
        rank: its prefetch is done, or the policy does not wait (best_effort), or waited long
        enough (timeout: since it started; wait_complete: since its last page arrived). Never
        blocks."""
        return bool(self.ranks_min(int(self._prefetch_ready(rid))))

    def _prefetch_ready(self, rid: str) -> bool:
        op = self.prefetcher.get(rid)
        if op is None or op.done.is_set() or self.prefetch_policy == "best_effort":
            return True
        since = op.created if self.prefetch_policy == "timeout" else op.last_progress
        if time.monotonic() - since < self._prefetch_timeout(op):
            return False
        self.prefetcher.give_up(op)
        return True

    def _prefetch_timeout(self, op: PrefetchOp) -> float:
        tokens = len(op.keys) * self.page_tokens
        return self.prefetch_timeout_s + self.prefetch_timeout_per_ki_token_s * tokens / 1024

    def wait_for_prefetch(self, timeout_s: float) -> None:
        """Nothing can run but requests waiting for prefetches: wait at most `timeout_s` for a
        page to arrive (instead of spinning)."""
        self.prefetcher.wait_progress(timeout_s)

    def release_prefetch(self, rid: str) -> None:
        """Request `rid` left the waiting queue without being admitted: revoke its prefetch."""
        self.prefetcher.release(rid)

    def load_from_storage(self, req: CacheReq, key: list[int] | tuple[int, ...]) -> int:
        """Load what follows the tree's device match of `key`: the host tier's nodes, then the
        pages the request's own prefetch has read (admission calls it just before offering
        `req`). Returns how many tokens it loaded; then the request's next match is that much
        longer, and other requests' earlier matches may be stale (the load may evict)."""
        extra_key = req_extra_key(req)
        from_host = super().load_from_storage(req, key)
        self._touch_hits(key, len(req.prefix_indices) + from_host, extra_key)
        from_storage = self._load_storage_pages(req.rid, key, extra_key)
        if from_storage and not getattr(req, "retracted_stain", False):
            req.storage_hit_tokens = getattr(req, "storage_hit_tokens", 0) + from_storage
        return from_host + from_storage

    def _load_storage_pages(self, rid: str, key: list[int] | tuple[int, ...], extra_key: str | None) -> int:
        op = self.prefetcher.get(rid)
        tokens = self._page_aligned(as_token_key(key))
        values, node, matched, pages, keys = [], self.root_node, 0, [], []
        if op is not None:
            if tokens:
                values, node = self._match_prefix_helper(tokens, extra_key)
            matched = sum(len(v) for v in values)
            pages, keys = self._fitting_pages(*self._usable_pages(op, tokens, matched, extra_key))
        num = self.ranks_min(len(pages))  # every rank loads the pages all of them have
        pages, keys = pages[:num], keys[:num]
        if not pages:
            self.prefetcher.release(rid)
            return 0
        loaded = self._load_pages(tokens, (values, node, matched), pages, keys, extra_key)
        if loaded is None:  # no pool room: the pages stay for the request's next turn
            return 0
        self.prefetcher.release(rid)
        if loaded:
            self._stored.update(keys)
        return loaded

    def _touch_hits(self, key: list[int] | tuple[int, ...], hit_len: int, extra_key: str | None) -> None:
        """The stored pages of a device or host hit were used: refresh their recency, so that the
        size bound keeps a hot prefix served from the tree (once per page between writes:
        the order against newer pages is all that counts)."""
        num = hit_len // self.page_tokens
        if not num:
            return
        self._forget_gone()
        stamp = self.writer.submitted
        keys = self._page_keys(as_token_key(key)[: num * self.page_tokens], num, extra_key)
        keys = [k for k in keys if k in self._stored and self._touched.get(k) != stamp]
        for k in keys:
            self._touched[k] = stamp
        if keys:
            self.writer.touch(keys)
        if len(self._touched) > 1 << 20:
            self._touched.clear()

    def _forget_gone(self) -> None:
        """Keys whose pages storage deleted (size bound, bad file) or never wrote (a failed
        write) are written again the next time a request goes through them."""
        for key in self.storage.take_removed() + self.writer.take_failed():
            self._stored.discard(key)
            self._touched.pop(key, None)

    def _usable_pages(
        self, op: PrefetchOp, tokens: tuple[int, ...], matched: int, extra_key: str | None
    ) -> tuple[list[torch.Tensor], list[str]]:
        """The pages of `op` that continue the tree's match of `tokens`: those from the page the
        match ends in, as long as their keys are the request's own."""
        pages = op.arrived()
        num_pages = len(tokens) // self.page_tokens
        start = matched // self.page_tokens
        if start < op.first_page or start >= num_pages:
            return [], []
        own = self._page_keys(tokens, num_pages, extra_key)
        end = op.first_page
        for page_key in op.keys[: len(pages)]:
            if end >= num_pages or own[end] != page_key:
                break
            end += 1
        lo, hi = start - op.first_page, end - op.first_page
        return pages[lo:hi], op.keys[lo:hi]

    def _fitting_pages(
        self, pages: list[torch.Tensor], keys: list[str]
    ) -> tuple[list[torch.Tensor], list[str]]:
        """The leading pages whose dtype and shape are the pool's; a page that is not is named,
        deleted and recomputed (with those after it)."""
        dtype, shape = self.kv_pool.dtype, self.storage.identity.page_shape()
        for i, (page, key) in enumerate(zip(pages, keys)):
            if page.dtype != dtype or tuple(page.shape) != shape:
                self.storage.discard(key, f"a page of {page.dtype} {tuple(page.shape)}, not {dtype} {shape}")
                return pages[:i], keys[:i]
        return pages, keys

    def _load_pages(
        self,
        tokens: tuple[int, ...],
        match: tuple[list[torch.Tensor], TreeNode, int],
        pages: list[torch.Tensor],
        keys: list[str],
        extra_key: str | None,
    ) -> int | None:
        """Copy `pages` in after the tree's match (its values, last node and length) in
        namespace `extra_key`; how many tokens, 0 if the copy failed, None if the pool has no
        room for them."""
        values, node, matched = match
        skip = matched - matched // self.page_tokens * self.page_tokens  # of the first page, in the tree
        num = len(pages) * self.page_tokens - skip
        slots = self._alloc_protecting(node, num)
        if slots is None:
            return None
        data = torch.cat(pages, dim=2)[:, :, skip:]
        if self.pool_write_stream is not None:
            self.pool_write_stream.submit(self._scatter, slots, data, label="hicache-load")
        else:
            try:
                self._scatter(slots, data)
            except (RuntimeError, ValueError) as e:  # nothing refers to the slots yet
                self.token_to_kv_pool_allocator.free(slots)
                for key in keys:
                    self.storage.discard(key, f"cannot be copied into the KV pool ({e})")
                return 0
        prefix = torch.cat(values) if values else self._empty()
        end = matched + num
        # counted_len=end: loading is no request's hit (lfu / slru count the request's own insert).
        present = self._insert_helper(tokens[:end], torch.cat((prefix, slots)), 0, end, extra_key)
        if present != matched:
            raise RuntimeError(f"load_from_storage: {present} tokens present, {matched} matched")
        self.storage_hit_tokens += num
        self.storage_pages_loaded += len(pages)
        return num

    def _scatter(self, slots: torch.Tensor, data: torch.Tensor) -> None:
        scatter_device(self.kv_pool, slots, data)

    # ---- writing ----

    def cache_finished_req(self, req: CacheReq, is_insert: bool = True) -> None:
        tokens = None
        if is_insert and self.write_policy != "write_back":
            all_len = finished_kv_len(req)
            tokens = tuple((list(req.origin_input_ids) + list(req.output_ids))[:all_len])
        super().cache_finished_req(req, is_insert)
        if tokens is not None and len(tokens) >= self.page_tokens:
            self._write_path(tokens, req_extra_key(req))

    def _write_path(self, tokens: tuple[int, ...], extra_key: str | None) -> None:
        """Write the pages of the tree's path for `tokens` (in namespace `extra_key`) that
        storage does not have yet."""
        num_pages = len(tokens) // self.page_tokens
        nodes, slots = self._path_for(tokens[: num_pages * self.page_tokens], extra_key)
        num_pages = len(slots) // self.page_tokens
        if not num_pages:
            return
        keys = self._page_keys(tokens, num_pages, extra_key)
        self._forget_gone()
        ends = _node_ends(nodes)
        todo = [k for k, key in enumerate(keys) if key not in self._stored]
        if self.write_policy == "write_through_selective":
            todo = [
                k for k in todo if self._page_owner(nodes, ends, k).hit_count >= WRITE_THROUGH_SELECTIVE_HITS
            ]
        self._submit(keys, todo, tokens, slots)

    def _page_owner(self, nodes: list[TreeNode], ends: list[int], k: int) -> TreeNode:
        """The node holding page k's last token."""
        last = (k + 1) * self.page_tokens - 1
        return next(n for n, end in zip(nodes, ends) if end > last)

    def _submit(self, keys: list[str], todo: list[int], tokens: tuple[int, ...], slots: torch.Tensor) -> None:
        """Copy pages `todo` out of the pool in one gather and hand them to the writer."""
        if not todo:
            return
        pts = self.page_tokens
        data = self._gather(torch.cat([slots[k * pts : (k + 1) * pts] for k in todo]))
        for j, k in enumerate(todo):
            page = data[:, :, j * pts : (j + 1) * pts]
            if self.writer.submit(keys[k], tokens[k * pts : (k + 1) * pts], page):
                self._stored.add(keys[k])
        if len(self._stored) > 1 << 20:
            self._stored.clear()

    def _gather(self, slots: torch.Tensor) -> torch.Tensor:
        return gather_device(self.kv_pool, slots).cpu()

    def _path_for(
        self, tokens: tuple[int, ...], extra_key: str | None
    ) -> tuple[list[TreeNode], torch.Tensor]:
        """The nodes of the tree's longest match of `tokens` in namespace `extra_key` and the
        slots of the match, without touching access times or splitting."""
        node, i = self.root_node, 0
        nodes: list[TreeNode] = []
        while i < len(tokens):
            child = node.children.get(self._child_key(tokens, i, extra_key))
            matched = 0 if child is None or child.value is None else self._match_len(child.key, tokens, i)
            if not matched:
                break
            nodes.append(child)
            i += matched
            if matched < len(child.key):
                break
            node = child
        slots = torch.cat([n.value for n in nodes])[:i] if nodes else self._empty()
        return nodes, slots

    def _evict_leaf(self, node: TreeNode) -> torch.Tensor:
        if self.write_policy == "write_back":
            self._write_back(node)
        return super()._evict_leaf(node)

    def _write_back(self, leaf: TreeNode) -> None:
        """Before eviction frees `leaf`: write the pages that end inside it."""
        path = []
        n = leaf
        while n is not self.root_node and n is not None:
            path.append(n)
            n = n.parent
        path.reverse()
        tokens = tuple(t for p in path for t in p.key)
        start = len(tokens) - len(leaf.key)
        num_pages = len(tokens) // self.page_tokens
        first = start // self.page_tokens
        if num_pages <= first:
            return
        slots = torch.cat([p.value for p in path])
        keys = self._page_keys(tokens, num_pages, leaf.extra_key)
        self._forget_gone()
        self._submit(keys, [k for k in range(first, num_pages) if keys[k] not in self._stored], tokens, slots)

    # ---- life ----

    def flush_storage(self) -> None:
        """Wait until every page handed to the writer is written."""
        self.writer.flush()

    def clear_storage(self) -> tuple[bool, str]:
        """Delete this identity's pages from the folder (other engines' subfolders stay). Pages
        the writer has queued are still written; prefetched pages already read stay usable."""
        deleted = self.storage.clear()
        self._stored.clear()
        self._touched.clear()
        return (
            True,
            f"Hierarchical cache storage cleared: {deleted} pages deleted from {self.storage.describe('')}.",
        )

    def close(self, timeout_s: float | None = None) -> None:
        self.writer.close(timeout_s)
        self.prefetcher.close()

    def storage_stats(self) -> dict[str, int]:
        return {
            "storage_hit_tokens": self.storage_hit_tokens,
            "storage_pages_loaded": self.storage_pages_loaded,
            "storage_pages_written": self.writer.written,
            "storage_pages_present": self.writer.present,
            "storage_pages_dropped": self.writer.dropped,
            "storage_write_failures": self.writer.failed,
            "storage_pages_queued": self.writer.queued(),
            "storage_prefetches": self.prefetcher.started,
            "storage_prefetches_in_flight": self.prefetcher.num_ops(),
            "storage_prefetches_given_up": self.prefetcher.given_up,
            "storage_prefetches_truncated": self.prefetcher.truncated,
            "storage_prefetch_bytes": self.prefetcher.held_bytes(),
            "storage_prefetch_reserved_bytes": self.prefetcher.reserved_bytes,
            "storage_prefetch_pages_read": self.prefetcher.pages_read,
            "storage_prefetch_misses": self.prefetcher.misses,
            "storage_bytes": self.storage.total_bytes(),
            "storage_max_bytes": self.storage.max_bytes,
        }

    def tier_stats(self) -> dict[str, int]:
        return {**super().tier_stats(), **self.storage_stats()}


def _node_ends(nodes: list[TreeNode]) -> list[int]:
    ends, total = [], 0
    for n in nodes:
        total += len(n.key)
        ends.append(total)
    return ends
