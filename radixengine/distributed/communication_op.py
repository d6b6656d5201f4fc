"""Collectives over the tensor-parallel group; each returns its input unchanged with one rank."""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from radixengine.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks (in place)."""
    group = get_tp_group()
    if group.world_size == 1:
        return x
    dist.all_reduce(x, group=group.device_group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order."""
    group = get_tp_group()
    if group.world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.world_size)]
    dist.all_gather(parts, x, group=group.device_group)
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_all_reduce_min(value: int) -> int:
    """The smallest `value` over the ranks (the KV pool size every rank can hold)."""
    group = get_tp_group()
    if group.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return int(t.item())


def all_ranks_agree(value: int) -> bool:
    """Whether every rank passed the same `value` (|value| < 2**63), over the CPU group."""
    group = get_tp_group()
    if group.world_size == 1:
        return True
    t = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.cpu_group)  # the largest and -the smallest
    return int(t[0]) == -int(t[1])


def broadcast_pyobj(obj: object, src: int = 0) -> object:
    """`obj` of rank `src` on every rank (pickled; the other ranks' `obj` is ignored)."""
    group = get_tp_group()
    if group.world_size == 1:
        return obj
    if group.rank == src:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        dist.broadcast(size, src=src, group=group.cpu_group)
        dist.broadcast(data, src=src, group=group.cpu_group)
        return obj
    size = torch.tensor([0], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group.cpu_group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=src, group=group.cpu_group)
    return pickle.loads(data.numpy().tobytes())
