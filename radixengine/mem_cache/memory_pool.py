"""ReqToTokenPool (request -> KV slots) and MHATokenToKVPool (the K and V tensors)."""

from __future__ import annotations

import math
import mmap
import operator
from typing import Protocol

import torch

# What `req_to_token[...]` takes: a row, a (rows, columns) pair of ints, slices or index tensors.
PoolIndex = int | slice | torch.Tensor | tuple[int | slice | torch.Tensor, int | slice | torch.Tensor]


class HasLayerId(Protocol):
    """A layer object (RadixAttention) in place of its `layer_id`."""

    layer_id: int


def check_count(name: str, value: object, minimum: int = 0) -> int:
    """`value` as an int >= `minimum`, or ValueError naming `name`."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got bool")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__}") from None
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


class ReqToTokenPool:
    """`req_to_token[row, i]` is the KV slot of token i of the request that holds `row`."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device):
        self.size = check_count("size", size, 1)
        self.max_context_len = check_count("max_context_len", max_context_len, 1)
        self.device = device
        self.req_to_token = torch.zeros((self.size, self.max_context_len), dtype=torch.int32, device=device)
        self.clear()

    def write(self, indices: PoolIndex, values: torch.Tensor | int) -> None:
        self.req_to_token[indices] = values

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int = 1) -> list[int] | None:
        need_size = check_count("need_size", need_size)
        if need_size > len(self.free_slots):
            return None
        select = self.free_slots[:need_size]
        del self.free_slots[:need_size]
        for row in select:
            self._is_free[row] = False
        return select

    def free(self, free_index: int | list[int]) -> None:
        rows = list(free_index) if isinstance(free_index, (list, tuple)) else [free_index]
        rows = [self._check_row(row) for row in rows]
        if len(set(rows)) != len(rows):
            raise ValueError(f"req_to_token_pool.free: rows {rows} repeat a row (double free)")
        for row in rows:
            self._is_free[row] = True
        self.free_slots.extend(rows)

    def _check_row(self, row: object) -> int:
        if isinstance(row, bool) or not hasattr(row, "__index__") or not 0 <= row.__index__() < self.size:
            raise ValueError(f"req_to_token_pool.free: row {row!r} is not in [0, {self.size})")
        if self._is_free[row.__index__()]:
            raise ValueError(f"req_to_token_pool.free: row {row} is already free (double free)")
        return row.__index__()

    def used_rows(self) -> list[int]:
        return [row for row, free in enumerate(self._is_free) if not free]

    def clear(self) -> None:
        self.free_slots = list(range(self.size))
        self._is_free = [True] * self.size


class MHATokenToKVPool:
    """Per layer, K and V of shape `[size + page_size, head_num, head_dim]`; slot 0 is padding
    (padded tokens write there) and the allocator never hands it out."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device,
    ):
        self.size = check_count("size", size, 1)
        self.page_size = check_count("page_size", page_size, 1)
        self.head_num = check_count("head_num", head_num, 1)
        self.head_dim = check_count("head_dim", head_dim, 1)
        self.layer_num = check_count("layer_num", layer_num, 1)
        self.dtype = dtype
        self.device = device
        shape = (self.size + self.page_size, self.head_num, self.head_dim)
        self.k_buffer = [self._new_buffer(shape) for _ in range(self.layer_num)]
        self.v_buffer = [self._new_buffer(shape) for _ in range(self.layer_num)]

    def _new_buffer(self, shape: tuple[int, ...]) -> torch.Tensor:
        if torch.device(self.device).type == "cpu":
            return zeroed_cpu_tensor(shape, self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(
        self, layer_id: int | HasLayerId, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor
    ) -> None:
        """Write K and V (`[n, head_num, head_dim]` or `[n, head_num * head_dim]`) at slots `loc`.
        `layer_id` may also be a layer object with a `layer_id` attribute."""
        layer_id = getattr(layer_id, "layer_id", layer_id)
        shape = (-1, self.head_num, self.head_dim)
        self.k_buffer[layer_id][loc] = cache_k.reshape(shape).to(self.dtype)
        self.v_buffer[layer_id][loc] = cache_v.reshape(shape).to(self.dtype)

    def get_kv_size_bytes(self) -> tuple[int, int]:
        k_bytes = sum(buf.numel() * buf.element_size() for buf in self.k_buffer)
        v_bytes = sum(buf.numel() * buf.element_size() for buf in self.v_buffer)
        return k_bytes, v_bytes


def zeroed_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in fresh anonymous memory: the OS supplies zero pages as they are first
    touched, so a pool of gigabytes costs nothing up front (torch.zeros writes every byte:
    seconds of start-up)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=dtype, count=math.prod(shape)).view(shape)
