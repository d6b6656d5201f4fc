"""KV slot allocators: TokenToKVPoolAllocator (one token at a time) and
PagedTokenToKVPoolAllocator (whole pages; requests continue their last partial page)."""

from __future__ import annotations

import torch

from radixengine.mem_cache.memory_pool import MHATokenToKVPool, check_count

IndexLike = torch.Tensor | list[int]


def _as_index_tensor(name: str, values: IndexLike, device: str | torch.device | None = None) -> torch.Tensor:
    tensor = torch.as_tensor(values, device=device)
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool or tensor.dtype.is_complex:
        raise ValueError(f"{name} must hold integers, got {tensor.dtype}")
    return tensor.reshape(-1).to(torch.int64)


class BaseTokenToKVPoolAllocator:
    """Free list of page ids `1..num_pages` (page id == slot when page_size is 1); page 0 is the
    padding slot and is never handed out.

    `free_mask[p]` is True while page p is free; it catches double frees and frees of slot 0.
    `device_checks=False` skips the checks that read slot values (frees, and the `last_loc` of
    paged allocations): with a GPU each would be a host sync. Allocating reads nothing
    from the device: the counts come from tensor shapes and the callers' host copies of the
    lengths, so a decode step's allocation never waits for the forward in flight."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
        kvcache: MHATokenToKVPool | None = None,
        *,
        need_sort: bool = False,
        device_checks: bool = True,
    ):
        self.size = check_count("size", size, 1)
        self.page_size = check_count("page_size", page_size, 1)
        if self.size % self.page_size:
            raise ValueError(f"size {self.size} must be a multiple of page_size {self.page_size}")
        self.num_pages = self.size // self.page_size
        self.dtype = dtype
        self.device = device
        self._kvcache = kvcache
        self.need_sort = need_sort
        self.device_checks = device_checks
        self.clear()

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self.release_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        # No scalar writes into device tensors (each would be a blocking host-to-device copy).
        self.free_mask = torch.arange(self.num_pages + 1, device=self.device) != 0
        self.is_not_in_free_group = True
        self.free_group: list[torch.Tensor] = []

    def get_kvcache(self) -> MHATokenToKVPool | None:
        return self._kvcache

    def available_size(self) -> int:
        return (len(self.free_pages) + len(self.release_pages)) * self.page_size

    def merge_and_sort_free(self) -> None:
        if len(self.release_pages):
            self.free_pages = torch.cat((self.free_pages, self.release_pages)).sort().values
            self.release_pages = self.release_pages[:0]

    def free_group_begin(self) -> None:
        self.is_not_in_free_group = False
        self.free_group = []

    def free_group_end(self) -> None:
        self.is_not_in_free_group = True
        if self.free_group:
            self.free(torch.cat(self.free_group))
        self.free_group = []

    def backup_state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.free_pages.clone(), self.release_pages.clone(), self.free_mask.clone()

    def restore_state(self, state: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        self.free_pages, self.release_pages, self.free_mask = (t.clone() for t in state)

    def free(self, free_index: IndexLike) -> None:
        """Return KV slots to the pool. Inside `free_group_begin/end` the slots are collected and
        freed together at the end."""
        free_index = _as_index_tensor("free_index", free_index, self.device)
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index)
            return
        pages = self._pages_of(free_index)
        if self.device_checks:
            self._check_free(free_index, pages)
        self.free_mask.index_fill_(0, pages, True)
        self._release(pages)

    def _take_pages(self, num_pages: int) -> torch.Tensor | None:
        if self.need_sort and num_pages > len(self.free_pages):
            self.merge_and_sort_free()
        if num_pages > len(self.free_pages):
            return None
        pages = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        self.free_mask.index_fill_(0, pages, False)
        return pages

    def _release(self, pages: torch.Tensor) -> None:
        if self.need_sort:
            self.release_pages = torch.cat((self.release_pages, pages))
        else:
            self.free_pages = torch.cat((self.free_pages, pages))

    def _pages_of(self, free_index: torch.Tensor) -> torch.Tensor:
        return free_index

    def _check_free(self, free_index: torch.Tensor, pages: torch.Tensor) -> None:
        low, high = self.page_size, (self.num_pages + 1) * self.page_size - 1
        out_of_range = (free_index < low) | (free_index > high)
        if bool(out_of_range.any()):
            bad = free_index[out_of_range][:8].tolist()
            raise ValueError(
                f"free: slots {bad} are outside the allocatable range [{low}, {high}] "
                "(slot 0 is the padding slot and is never allocated)"
            )
        already_free = self.free_mask[pages]
        if bool(already_free.any()):
            bad = pages[already_free][:8] * self.page_size
            raise ValueError(f"free: double free of slots starting at {bad.tolist()} (already free)")
        if self.page_size == 1 and len(torch.unique(pages)) != len(pages):
            raise ValueError("free: a slot appears twice in one free (double free)")


class TokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """Hands out single KV slots `1..size`."""

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        device: str | torch.device,
        kvcache: MHATokenToKVPool | None = None,
        *,
        need_sort: bool = False,
        device_checks: bool = True,
    ):
        super().__init__(size, 1, dtype, device, kvcache, need_sort=need_sort, device_checks=device_checks)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` free slots (int64), or None (nothing changes) if there are not enough."""
        return self._take_pages(check_count("need_size", need_size))


class PagedTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """Hands out whole pages: page p covers slots `p * page_size + [0, page_size)`. Freeing any slot
    of a page frees the page."""

    def _pages_of(self, free_index: torch.Tensor) -> torch.Tensor:
        return torch.unique(free_index // self.page_size)

    def _release(self, pages: torch.Tensor) -> None:
        if self.need_sort:
            self.release_pages = torch.cat((self.release_pages, pages))
        else:
            self.free_pages = torch.cat((pages, self.free_pages))

    def _expand(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=pages.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` slots made of whole pages (`need_size % page_size == 0`), or None."""
        need_size = check_count("need_size", need_size)
        if need_size % self.page_size:
            raise ValueError(f"alloc: need_size {need_size} is not a multiple of page_size {self.page_size}")
        pages = self._take_pages(need_size // self.page_size)
        return None if pages is None else self._expand(pages)

    def alloc_extend(
        self,
        prefix_lens: IndexLike,
        seq_lens: IndexLike,
        last_loc: IndexLike,
        extend_num_tokens: int,
        *,
        prefix_lens_cpu: IndexLike | None = None,
        seq_lens_cpu: IndexLike | None = None,
    ) -> torch.Tensor | None:
        """Slots for tokens `prefix_lens[i]:seq_lens[i]` of each request, concatenated. A request
        first fills its last partial page (after `last_loc[i]`, the slot of token
        `prefix_lens[i] - 1`, or -1 with no prefix), then takes new pages. None if short of pages.
        Pass the `*_cpu` copies when the lengths live on the GPU, to skip a device sync."""
        ps = self.page_size
        pre = _as_index_tensor("prefix_lens", prefix_lens, self.device)
        seq = _as_index_tensor("seq_lens", seq_lens, self.device)
        last = _as_index_tensor("last_loc", last_loc, self.device)
        pre_cpu = _as_index_tensor(
            "prefix_lens_cpu", pre if prefix_lens_cpu is None else prefix_lens_cpu, "cpu"
        )
        seq_cpu = _as_index_tensor("seq_lens_cpu", seq if seq_lens_cpu is None else seq_lens_cpu, "cpu")
        extend_num_tokens = check_count("extend_num_tokens", extend_num_tokens)
        self._check_extend_args(pre_cpu, seq_cpu, last, extend_num_tokens)

        new_pages = _ceil_div(seq_cpu, ps) - _ceil_div(pre_cpu, ps)
        pages = self._take_pages(int(new_pages.sum()))
        if pages is None:
            return None
        return self._extend_locs(pre, seq, last, pages, extend_num_tokens)

    def _check_extend_args(
        self, pre: torch.Tensor, seq: torch.Tensor, last: torch.Tensor, extend_num_tokens: int
    ) -> None:
        if not pre.shape == seq.shape == last.shape:
            raise ValueError(f"alloc_extend: shapes differ: {pre.shape}, {seq.shape}, {last.shape}")
        if bool((pre < 0).any()) or bool((seq < pre).any()):
            raise ValueError(
                f"alloc_extend: need 0 <= prefix_lens <= seq_lens, got {pre.tolist()}, {seq.tolist()}"
            )
        if int((seq - pre).sum()) != extend_num_tokens:
            raise ValueError(
                f"alloc_extend: extend_num_tokens {extend_num_tokens} != sum(seq_lens - prefix_lens)"
            )
        if self.device_checks:
            has_prefix = pre > 0
            wrong = has_prefix & (last % self.page_size != (pre - 1) % self.page_size)
            if bool(wrong.any()):
                raise ValueError(
                    f"alloc_extend: last_loc {last.tolist()} is not the slot of token prefix_len - 1"
                )

    def _extend_locs(
        self, pre: torch.Tensor, seq: torch.Tensor, last: torch.Tensor, pages: torch.Tensor, num_tokens: int
    ) -> torch.Tensor:
        ps, device = self.page_size, pre.device
        extend_lens = seq - pre
        req = torch.repeat_interleave(
            torch.arange(len(pre), device=device), extend_lens, output_size=num_tokens
        )
        start = torch.cumsum(extend_lens, 0) - extend_lens
        pos = pre[req] + torch.arange(num_tokens, device=device) - start[req]
        pre_ceil = _ceil_div(pre, ps) * ps
        req_pages = _ceil_div(seq, ps) - _ceil_div(pre, ps)
        first_page = torch.cumsum(req_pages, 0) - req_pages

        in_last_page = pos < pre_ceil[req]
        page_idx = first_page[req] + torch.div(pos - pre_ceil[req], ps, rounding_mode="floor").clamp(min=0)
        padded = torch.cat((pages.to(device), torch.zeros(1, dtype=torch.int64, device=device)))
        new_page_loc = padded[page_idx.clamp(max=len(pages))] * ps + pos % ps
        return torch.where(in_last_page, last[req] + 1 + (pos - pre[req]), new_page_loc)

    def alloc_decode(
        self, seq_lens: IndexLike, last_loc: IndexLike, *, seq_lens_cpu: IndexLike | None = None
    ) -> torch.Tensor | None:
        """One slot per request for its token at position `seq_lens[i] - 1` (`seq_lens` counts the
        new token): `last_loc[i] + 1`, or a new page when that token starts one. None if short."""
        ps = self.page_size
        seq = _as_index_tensor("seq_lens", seq_lens, self.device)
        last = _as_index_tensor("last_loc", last_loc, self.device)
        seq_cpu = _as_index_tensor("seq_lens_cpu", seq if seq_lens_cpu is None else seq_lens_cpu, "cpu")
        if seq.shape != last.shape:
            raise ValueError(f"alloc_decode: shapes differ: {seq.shape}, {last.shape}")
        if bool((seq_cpu < 1).any()):
            raise ValueError(
                f"alloc_decode: seq_lens must be >= 1 (after the increment), got {seq_cpu.tolist()}"
            )
        if self.device_checks and bool(((last + 1) % ps != (seq - 1) % ps).any()):
            raise ValueError(f"alloc_decode: last_loc {last.tolist()} is not the slot of token seq_len - 2")

        pages = self._take_pages(int(((seq_cpu - 1) % ps == 0).sum()))
        if pages is None:
            return None
        needs_page = (seq - 1) % ps == 0
        page_idx = (torch.cumsum(needs_page.to(torch.int64), 0) - 1).clamp(min=0)
        padded = torch.cat((pages.to(seq.device), torch.zeros(1, dtype=torch.int64, device=seq.device)))
        return torch.where(needs_page, padded[page_idx] * ps, last + 1)


def _ceil_div(values: torch.Tensor, divisor: int) -> torch.Tensor:
    return torch.div(values + divisor - 1, divisor, rounding_mode="floor")
