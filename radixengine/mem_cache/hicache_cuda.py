"""The host tier's CUDA parts: pinned host memory and copies on their own stream.

Only a CUDA run imports this module (managers/hicache_factory.py, when the KV pool is on a CUDA
device); nothing here runs on a CPU-only machine, and it has not been run in this project's CPU
test suite. A load gathers the host slots into a pinned staging buffer (a host memcpy) and copies it to
the device on the copy stream (asynchronously, overlapping the forward in flight); the scatter
into the pool runs on the stream of the forwards, in order, after waiting for the copy's event. A backup gathers the device slots on the copy stream (after the work already on the
compute stream), copies them to a pinned staging buffer and waits for that copy before
scattering it into the host pool, so that the device slots can be freed right after.
"""

from __future__ import annotations

import torch

from radixengine.mem_cache.base_prefix_cache import PoolWriteStream
from radixengine.mem_cache.hicache_transfer import gather_device, scatter_device
from radixengine.mem_cache.memory_pool import MHATokenToKVPool
from radixengine.mem_cache.memory_pool_host import HostKVPool


def pinned_host_pool(device_pool: MHATokenToKVPool, size: int) -> HostKVPool:
    """A host pool of `size` slots in pinned (page-locked) memory."""
    p = device_pool
    shape = (p.layer_num, 2, size, p.head_num, p.head_dim)
    # Not zeroed (that would touch every page of a pool of many GB): a slot is read only after
    # a backup wrote it.
    return HostKVPool.like(device_pool, size, torch.empty(shape, dtype=p.dtype, pin_memory=True))


class CudaEventAck:
    def __init__(self, event: torch.cuda.Event, keep: tuple[torch.Tensor, ...]) -> None:
        self.event = event
        self._keep = keep  # staging buffers the copy reads, alive until it is done

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


class CudaHostTransfer:
    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)

    def backup(
        self, device: MHATokenToKVPool, device_slots: torch.Tensor, host: HostKVPool, host_slots: torch.Tensor
    ) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            data = gather_device(device, device_slots)
            staging = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
            staging.copy_(data, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()
        host.scatter(host_slots, staging)

    def load(
        self,
        host: HostKVPool,
        host_slots: torch.Tensor,
        device: MHATokenToKVPool,
        device_slots: torch.Tensor,
        stream: PoolWriteStream | None,
    ) -> CudaEventAck:
        staging = host.gather(host_slots).pin_memory()
        with torch.cuda.stream(self.stream):
            data = staging.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        # The scatter runs in order on the stream that runs the forwards (the slots may have been
        # freed by a request whose last forward is still in flight), after the copy.
        if stream is None:
            _scatter_after(copied, device, device_slots, data)
        else:
            stream.submit(_scatter_after, copied, device, device_slots, data, label="hicache-host-load")
        return CudaEventAck(copied, (staging, data))


def _scatter_after(
    event: torch.cuda.Event, device: MHATokenToKVPool, device_slots: torch.Tensor, data: torch.Tensor
) -> None:
    stream = torch.cuda.current_stream(data.device)
    stream.wait_event(event)
    data.record_stream(stream)  # allocated on the copy stream, read here: not reused before
    scatter_device(device, device_slots, data)
