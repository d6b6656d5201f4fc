"""Copies between the device KV pool and the host pool (SGLang's HiCacheController, reduced).

`InlineHostTransfer` copies by index on the calling thread, except that a load into the device
pool goes through the pool's write stream when the overlap loop set one (it runs there in order
after the forward in flight, as the storage tier's loads do); its ack is done once that ran. It
serves every device (a CPU pool is host memory: the tier then only moves bytes within it).
CUDA's copy stream and pinned memory are in mem_cache/hicache_cuda.py, which only a CUDA run
imports.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

from radixengine.mem_cache.base_prefix_cache import PoolWriteStream
from radixengine.mem_cache.memory_pool import MHATokenToKVPool
from radixengine.mem_cache.memory_pool_host import HostKVPool


class TransferAck(Protocol):
    """A copy in flight: the host slots it reads stay locked until `done()`."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class HostTransfer(Protocol):
    def backup(
        self, device: MHATokenToKVPool, device_slots: torch.Tensor, host: HostKVPool, host_slots: torch.Tensor
    ) -> None:
        """Copy device slots to host slots; on return the device slots may be reused."""

    def load(
        self,
        host: HostKVPool,
        host_slots: torch.Tensor,
        device: MHATokenToKVPool,
        device_slots: torch.Tensor,
        stream: PoolWriteStream | None,
    ) -> TransferAck:
        """Copy host slots into device slots, ordered before the next forward."""


class EventAck:
    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        self._event.wait()


def gather_device(device: MHATokenToKVPool, slots: torch.Tensor) -> torch.Tensor:
    """`[layer_num, 2, len(slots), head_num, head_dim]` of the device pool's slots."""
    index = slots.to(device.k_buffer[0].device)
    return torch.stack(
        [torch.stack((device.k_buffer[i][index], device.v_buffer[i][index])) for i in range(device.layer_num)]
    )


def scatter_device(device: MHATokenToKVPool, slots: torch.Tensor, data: torch.Tensor) -> None:
    index = slots.to(device.k_buffer[0].device)
    for layer in range(device.layer_num):
        device.k_buffer[layer][index] = data[layer, 0].to(device.k_buffer[layer].device)
        device.v_buffer[layer][index] = data[layer, 1].to(device.v_buffer[layer].device)


class InlineHostTransfer:
    def backup(
        self, device: MHATokenToKVPool, device_slots: torch.Tensor, host: HostKVPool, host_slots: torch.Tensor
    ) -> None:
        host.scatter(host_slots, gather_device(device, device_slots).cpu())

    def load(
        self,
        host: HostKVPool,
        host_slots: torch.Tensor,
        device: MHATokenToKVPool,
        device_slots: torch.Tensor,
        stream: PoolWriteStream | None,
    ) -> TransferAck:
        ack = EventAck()
        if stream is None:
            scatter_device(device, device_slots, host.gather(host_slots))
            ack.set()
        else:
            stream.submit(_load, host, host_slots, device, device_slots, label="hicache-host-load")
            stream.submit(ack.set, label="hicache-host-load-ack")
        return ack


def _load(
    host: HostKVPool, host_slots: torch.Tensor, device: MHATokenToKVPool, device_slots: torch.Tensor
) -> None:
    scatter_device(device, device_slots, host.gather(host_slots))
