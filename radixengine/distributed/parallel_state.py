"""This process's place in the tensor-parallel group (SGLang's parallel_state, one group only).

Two process groups over the same ranks: `device_group` carries the model's collectives (NCCL on
CUDA, gloo on a CPU) and `cpu_group` (always gloo) carries Python objects, the scheduler's
broadcast of the requests it received. Separate groups keep the two streams of collectives apart
when the forward runs on its own thread (overlap schedule). The gloo `timeout` bounds every
collective: a peer that stops answering raises instead of hanging.

`single_rank_group` gives one thread a group of one rank: a model built there is whole on this
rank and runs no collective (STANDALONE's draft model, run by rank 0 alone)."""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TpGroup:
    rank: int
    world_size: int
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    device: str = "cpu"

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0


_TP = TpGroup(rank=0, world_size=1)
_THREAD = threading.local()  # `group`: this thread's own group (single_rank_group), else _TP


def resolve_backend(backend: str, device: str) -> str:
    """`auto`: nccl on CUDA, gloo on a CPU."""
    if backend != "auto":
        return backend
    return "nccl" if device.startswith("cuda") else "gloo"


def init_distributed(
    tp_size: int,
    rank: int,
    init_method: str | None = None,
    backend: str = "auto",
    device: str = "cpu",
    local_rank: int | None = None,
    timeout_s: float = 300.0,
) -> TpGroup:
    """Join the group of `tp_size` ranks as `rank`; with `tp_size == 1` only records it (no
    process group, no cost). On CUDA the rank uses GPU `local_rank` (default: `rank`)."""
    global _TP
    if not 0 <= rank < tp_size:
        raise ValueError(f"TP rank {rank} is outside [0, {tp_size})")
    if tp_size == 1:
        _TP = TpGroup(rank=0, world_size=1, device=device)
        return _TP
    if init_method is None:
        raise ValueError("init_distributed needs an init_method (tcp://host:port) for more than one rank")
    if device.startswith("cuda"):
        torch.cuda.set_device(rank if local_rank is None else local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = resolve_backend(backend, device)
    dist.init_process_group(backend, init_method=init_method, world_size=tp_size, rank=rank, timeout=timeout)
    ranks = list(range(tp_size))
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(ranks, backend="gloo", timeout=timeout)
    _TP = TpGroup(rank, tp_size, device_group, cpu_group, device)
    logger.info("TP rank %d of %d joined (%s, %s)", rank, tp_size, backend, init_method)
    return _TP


def destroy_distributed() -> None:
    global _TP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP = TpGroup(rank=0, world_size=1)


_THREAD = threading.local()  # `group`: this thread's own group (single_rank_group), else _TP


def get_tp_group() -> TpGroup:
    return getattr(_THREAD, "group", None) or _TP


@contextmanager
def single_rank_group() -> Iterator[None]:
    """On this thread only, a group of one rank (the other threads, e.g. the forward stream's,
    keep the real one)."""
    outer = getattr(_THREAD, "group", None)
    _THREAD.group = TpGroup(rank=0, world_size=1, device=_TP.device)
    try:
        yield
    finally:
        _THREAD.group = outer


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size
