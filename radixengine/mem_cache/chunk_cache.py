"""ChunkCache: the prefix-cache interface without sharing (`--disable-radix-cache`).

Nothing is ever matched. A request keeps its own KV slots: `cache_unfinished_req` only records
them in `req.prefix_indices` (so the next chunk reuses them) and `cache_finished_req` frees them.
`protected_size()` counts the slots so recorded for requests still running.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from radixengine.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    CacheNode,
    CacheReq,
    MatchResult,
    as_token_key,
    finished_kv_len,
    req_kv_indices,
)
from radixengine.mem_cache.memory_pool import check_count

if TYPE_CHECKING:
    from radixengine.mem_cache.allocator import BaseTokenToKVPoolAllocator
    from radixengine.mem_cache.memory_pool import ReqToTokenPool


class ChunkCache(BasePrefixCache):
    disable: ClassVar[bool] = True

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool | None,
        token_to_kv_pool_allocator: BaseTokenToKVPoolAllocator | None,
        page_size: int = 1,
    ):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = check_count("page_size", page_size, 1)
        self.device = getattr(token_to_kv_pool_allocator, "device", "cpu")
        self.reset()

    def reset(self) -> None:
        self.protected_size_ = 0

    def match_prefix(self, key: list[int] | tuple[int, ...], extra_key: str | None = None) -> MatchResult:
        as_token_key(key)
        return MatchResult(torch.empty((0,), dtype=torch.int64, device=self.device), None)

    def insert(self, key: list[int] | tuple[int, ...], value: torch.Tensor | None = None) -> int:
        """Stores nothing: the caller keeps ownership of `value`."""
        as_token_key(key)
        return 0

    def evict(self, num_tokens: int) -> int:
        check_count("num_tokens", num_tokens)
        return 0

    def inc_lock_ref(self, node: CacheNode | None) -> int:
        return 0

    def dec_lock_ref(self, node: CacheNode | None) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return self.protected_size_

    def total_size(self) -> int:
        return self.protected_size_

    def cache_finished_req(self, req: CacheReq, is_insert: bool = True) -> None:
        kv = req_kv_indices(self.req_to_token_pool, req, finished_kv_len(req))
        self.token_to_kv_pool_allocator.free(kv)
        self.req_to_token_pool.free(req.req_pool_idx)
        self.protected_size_ -= len(req.prefix_indices)

    def cache_unfinished_req(self, req: CacheReq) -> None:
        kv = req_kv_indices(self.req_to_token_pool, req, len(req.fill_ids))
        self.protected_size_ += len(kv) - len(req.prefix_indices)
        req.prefix_indices = kv

    def pretty_print(self) -> None:
        print(f"ChunkCache: no tree; {self.protected_size_} tokens recorded for running requests")
