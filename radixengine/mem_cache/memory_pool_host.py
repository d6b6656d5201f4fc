"""HostKVPool: the host tier's KV slots (SGLang's MHATokenToKVPoolHost).

One buffer `[layer_num, 2 (K, V), size, head_num, head_dim]` in host memory (pinned on CUDA:
mem_cache/hicache_cuda.py allocates it) and a free list of its slots. A node evicted from the
device pool keeps its KV here; slots are handed out one per token, so a node's host slots need
not be contiguous (copies are by index).
"""

from __future__ import annotations

import torch

from radixengine.mem_cache.memory_pool import MHATokenToKVPool, check_count, zeroed_cpu_tensor


class HostKVPool:
    def __init__(
        self,
        size: int,
        layer_num: int,
        head_num: int,
        head_dim: int,
        dtype: torch.dtype,
        buffer: torch.Tensor | None = None,
    ) -> None:
        self.size = check_count("host pool size", size, 1)
        self.layer_num, self.head_num, self.head_dim = layer_num, head_num, head_dim
        self.dtype = dtype
        shape = (layer_num, 2, self.size, head_num, head_dim)
        if buffer is None:
            buffer = zeroed_cpu_tensor(shape, dtype)
        if tuple(buffer.shape) != shape or buffer.dtype != dtype or buffer.device.type != "cpu":
            raise ValueError(f"host KV buffer {tuple(buffer.shape)} {buffer.dtype} on {buffer.device}")
        self.buffer = buffer
        self.clear()

    @classmethod
    def like(cls, device_pool: MHATokenToKVPool, size: int, buffer: torch.Tensor | None = None) -> HostKVPool:
        """A host pool of `size` slots for the KV of `device_pool`."""
        p = device_pool
        return cls(size, p.layer_num, p.head_num, p.head_dim, p.dtype, buffer)

    @staticmethod
    def bytes_per_token(device_pool: MHATokenToKVPool) -> int:
        p = device_pool
        return 2 * p.layer_num * p.head_num * p.head_dim * torch.empty((), dtype=p.dtype).element_size()

    def clear(self) -> None:
        self.free_slots = torch.arange(self.size, dtype=torch.int64)

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        need_size = check_count("need_size", need_size)
        if need_size > len(self.free_slots):
            return None
        select = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return select

    def free(self, slots: torch.Tensor) -> None:
        if len(slots):
            self.free_slots = torch.cat((self.free_slots, slots.to(torch.int64)))

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The KV of `slots` as one tensor `[layer_num, 2, len(slots), head_num, head_dim]`."""
        return self.buffer[:, :, slots]

    def scatter(self, slots: torch.Tensor, data: torch.Tensor) -> None:
        """Write `data` (`[layer_num, 2, len(slots), head_num, head_dim]`) at `slots`."""
        self.buffer[:, :, slots] = data.to(self.dtype)
