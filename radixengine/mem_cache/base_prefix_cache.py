"""The prefix-cache contract shared by RadixCache and ChunkCache, and the helpers both use."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from radixengine.mem_cache.memory_pool import ReqToTokenPool


class CacheNode(Protocol):
    """The handle of a cached prefix: the node that ends it (RadixCache's `TreeNode`). A request
    holds it (`last_node`) and the cache keeps it locked (`inc_lock_ref`) while the request uses
    the prefix's KV slots; `lock_ref` counts the locks."""

    lock_ref: int


class PoolWriteStream(Protocol):
    """A stream that runs a function after the work submitted before it (utils.streams)."""

    def submit(self, fn: Callable[..., object], *args: object, label: str = "") -> object: ...


class CacheReq(Protocol):
    """What a cache needs of a request; the scheduler's `Req` provides it."""

    origin_input_ids: list[int]
    output_ids: list[int]
    fill_ids: list[int]
    req_pool_idx: int
    prefix_indices: torch.Tensor
    last_node: CacheNode | None  # None: no tree (ChunkCache), or nothing matched yet
    hit_counted_len: int  # its tokens whose tree nodes counted it as a hit (lfu, slru), kept by the tree


class MatchResult(NamedTuple):
    """`device_indices`: int64 KV slots of the cached prefix, one per token.
    `last_node`: the node that ends the prefix (None for a cache without a tree); lock it before
    using the indices."""

    device_indices: torch.Tensor
    last_node: CacheNode | None


def as_token_key(key: object) -> tuple[int, ...]:
    """Check that `key` is a list or tuple of int token ids and return it as a tuple."""
    if isinstance(key, tuple):
        tokens = key
    elif isinstance(key, list):
        tokens = tuple(key)
    else:
        raise TypeError(f"key must be a list or tuple of int token ids, got {type(key).__name__}")
    # A sum of ints is an int; any float, str, None, numpy scalar... changes its type or raises.
    # It is several times cheaper than testing each element's type.
    try:
        all_ints = type(sum(tokens)) is int
    except TypeError:
        all_ints = False
    if not all_ints:
        tokens = tuple(map(_token_id, tokens))
    return tokens


def _token_id(token: object) -> int:
    if isinstance(token, (float, str, bytes)) or not hasattr(token, "__index__"):
        raise TypeError(f"key must hold int token ids, found {type(token).__name__} {token!r}")
    return token.__index__()


def finished_kv_len(req: CacheReq) -> int:
    """Tokens of a request that have KV: the last sampled token has none yet."""
    return len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)


def req_kv_indices(req_to_token_pool: ReqToTokenPool, req: CacheReq, length: int) -> torch.Tensor:
    """An int64 copy of the first `length` KV slots of the request's row."""
    row = req_to_token_pool.req_to_token[req.req_pool_idx, :length]
    return row.to(torch.int64, copy=True)


class BasePrefixCache(ABC):
    """A cache of KV slots keyed by token-id prefixes.

    Ownership: a KV slot belongs either to the cache (it was inserted) or to exactly one request
    (allocated for it and not yet handed over). `cache_finished_req` / `cache_unfinished_req` hand a
    request's slots over and free whatever the cache already held, so no slot is ever owned twice.

    Accounting: `evictable_size() + protected_size()` is every token the cache holds; with the
    allocator's `available_size()` it adds up to the pool size whenever no request is running.
    """

    # True for a cache that never shares a prefix (ChunkCache, `--disable-radix-cache`): nothing
    # matches, so cache-aware scheduling and in-batch prefix dedup have nothing to work with.
    disable: ClassVar[bool]

    @abstractmethod
    def reset(self) -> None:
        """Forget everything (the caller clears the allocator)."""

    @abstractmethod
    def match_prefix(self, key: list[int] | tuple[int, ...], extra_key: str | None = None) -> MatchResult:
        """The longest cached prefix of `key` (page-aligned) in the namespace `extra_key` (a
        LoRA adapter's id; None: the base model's). The indices are valid only while
        `last_node` is locked or until the next call that may evict."""

    @abstractmethod
    def insert(self, key: list[int] | tuple[int, ...], value: torch.Tensor | None = None) -> int:
        """Cache `value[i]` as the KV slot of `key[:i + 1]`; returns how many leading tokens were
        already cached. The cache takes ownership of `value[returned:]`; the caller still owns,
        and must free, `value[:returned]`."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked tokens, least recently used first, if there are
        that many; returns how many were freed (whole nodes, so it may be more)."""

    @abstractmethod
    def inc_lock_ref(self, node: CacheNode | None) -> int:
        """Protect the path from `node` to the root from eviction; returns the change in
        `evictable_size()`."""

    @abstractmethod
    def dec_lock_ref(self, node: CacheNode | None) -> int:
        """Undo one `inc_lock_ref(node)`; raises if the node is not locked. Returns the change in
        `evictable_size()`."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens held by the cache that nothing locks."""

    @abstractmethod
    def protected_size(self) -> int:
        """Tokens held by the cache that some request protects."""

    @abstractmethod
    def total_size(self) -> int:
        """Tokens held by the cache, counted afresh."""

    @abstractmethod
    def cache_finished_req(self, req: CacheReq, is_insert: bool = True) -> None:
        """Hand over a finished (or, with `is_insert=False`, retracted) request: keep or free its
        KV slots, free its `req_to_token` row and release its lock. Every token of
        `origin_input_ids + output_ids[:-1]` must have its KV slot in the row."""

    @abstractmethod
    def cache_unfinished_req(self, req: CacheReq) -> None:
        """Hand over the KV of `req.fill_ids` while the request goes on (a chunk of a prompt
        still being prefilled, or the whole prompt after its prefill). Afterwards
        `req.prefix_indices` lists the slots to reuse, the request's row points at them, and
        `req.last_node` is locked in place of the old one."""

    def load_from_storage(self, req: CacheReq, key: list[int] | tuple[int, ...]) -> int:
        """Load pages of `key` past the cached prefix from a lower tier (host pool, storage); returns
        how many tokens it loaded. A cache without one has nothing to load."""
        return 0

    def prefetch_from_storage(
        self, rid: str, key: list[int] | tuple[int, ...], extra_key: str | None = None
    ) -> None:
        """Request `rid` entered the waiting queue: start reading the pages of `key` (in namespace
        `extra_key`) past what the cache holds from a storage tier, for that request; nothing
        without one."""
        return None

    def check_prefetch_progress(self, rid: str) -> bool:
        """Whether request `rid` may be admitted now (its prefetch is done or need not be waited
        for); never blocks. Always without a storage tier."""
        return True

    def wait_for_prefetch(self, timeout_s: float) -> None:
        """Nothing can run but requests waiting for prefetches: wait at most `timeout_s` for one
        to progress; nothing to wait for without a storage tier."""
        return None

    def clear_storage(self) -> tuple[bool, str]:
        """Delete the storage tier's pages (SGLang's /hicache/storage-backend/clear): whether it
        did, and what it says."""
        return False, "No storage tier: start with --hicache-storage-backend file."

    def release_prefetch(self, rid: str) -> None:
        """Request `rid` left the waiting queue without being admitted: drop its prefetch."""
        return None

    def set_namespace_digests(self, digest_of: Callable[[str], bytes | None]) -> None:
        """Where a storage tier learns what a namespace's KV depends on (`digest_of(extra_key)`:
        a LoRA adapter's weights' digest, None if unknown); nothing without one."""
        return None

    def set_pool_write_stream(self, stream: PoolWriteStream) -> None:
        """Where the cache's own writes into the KV pool run (the overlap loop's forward stream);
        a cache that writes no KV of its own has nothing to route."""
        return None

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the cache's background work (a lower tier's threads), finishing its queued
        writes for at most `timeout_s` (None: no bound); nothing by default."""
        return None

    def tier_accounting_problem(self) -> str | None:
        """What is wrong with a lower tier's own slot accounting (the host pool), if anything."""
        return None

    def tier_stats(self) -> dict[str, int]:
        """Counters of the lower tiers (host pool, storage); none without them."""
        return {}

    @abstractmethod
    def pretty_print(self) -> None:
        """Print the cache's contents."""
