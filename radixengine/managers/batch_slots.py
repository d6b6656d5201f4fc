"""Where a batch's memory comes from: request rows and KV slots, evicting from the tree cache
when the pool is short, and the errors that say what did not fit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixengine.managers.req import Req
from radixengine.mem_cache.allocator import BaseTokenToKVPoolAllocator
from radixengine.mem_cache.base_prefix_cache import BasePrefixCache
from radixengine.mem_cache.memory_pool import ReqToTokenPool
from radixengine.utils.host_to_device import host_tensor


@dataclass(frozen=True)
class BatchSlots:
    req_to_token_pool: ReqToTokenPool
    allocator: BaseTokenToKVPoolAllocator
    tree_cache: BasePrefixCache
    page_size: int
    device: torch.device | str

    def evict_for(self, num_tokens: int) -> None:
        shortfall = num_tokens - self.allocator.available_size()
        if shortfall > 0:
            self.tree_cache.evict(shortfall)

    def alloc_failed(self, what: str, num_tokens: int) -> RuntimeError:
        avail = self.allocator.available_size()
        evictable = self.tree_cache.evictable_size()
        return RuntimeError(
            f"Out of memory allocating {num_tokens} KV slots for {what} "
            f"(available {avail}, evictable {evictable}). Try a smaller batch."
        )

    def alloc_rows(self, reqs: list[Req]) -> list[int]:
        """Each request's row of req_to_token (a chunked request keeps its own)."""
        rows: list[int | None] = [r.req_pool_idx for r in reqs]
        need = sum(1 for x in rows if x is None)
        fresh = self.req_to_token_pool.alloc(need) if need else []
        if fresh is None:
            raise RuntimeError(
                f"No free request rows for {need} requests (available "
                f"{self.req_to_token_pool.available_size()}); lower --max-running-requests."
            )
        it = iter(fresh)
        return [x if x is not None else next(it) for x in rows]

    def alloc_extend(
        self,
        reqs: list[Req],
        prefix_lens: list[int],
        seq_lens: list[int],
        num_tokens: int,
        last_loc: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Slots for the extend of every request; with pages, `last_loc` is the slot of each
        request's last cached token (-1: none; default: its prefix's)."""
        if self.page_size == 1:
            self.evict_for(num_tokens)
            out = self.allocator.alloc(num_tokens)
        else:
            self.evict_for(num_tokens + len(reqs) * self.page_size)
            if last_loc is None:
                last = [int(r.prefix_indices[-1]) if p > 0 else -1 for r, p in zip(reqs, prefix_lens)]
                last_loc = int64_tensor(last, self.device)
            out = self.allocator.alloc_extend(
                int64_tensor(prefix_lens, self.device),
                int64_tensor(seq_lens, self.device),
                last_loc,
                num_tokens,
                prefix_lens_cpu=int64_tensor(prefix_lens),
                seq_lens_cpu=int64_tensor(seq_lens),
            )
        if out is None:
            raise self.alloc_failed("prefill", num_tokens)
        return out


def int64_tensor(values, device: torch.device | str = "cpu") -> torch.Tensor:
    return host_tensor(values, torch.int64, device)
