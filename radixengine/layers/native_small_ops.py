"""When the CPU forward takes the native fused small ops (`native_cpu_ops`: RMSNorm, RMSNorm with
the residual add, rotary embedding, SiLU-and-mul, KV write) instead of the torch expressions they
replace.

They run for CPU tensors in a dtype the kernels support (float32, bfloat16) when the extension is
built, unless `RADIXENGINE_NATIVE_OPS=0` (read once, at import) turns them off for A/B runs; tests
switch them with `set_native_small_ops` / `native_small_ops`. Without the extension the torch path
is the one expected; `log_native_small_ops_state` says which path runs and why, once.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from radixengine.layers.attention import native_cpu_ops

logger = logging.getLogger(__name__)

ENV_VAR = "RADIXENGINE_NATIVE_OPS"

_switched_on: bool = False
_active: bool = False


def native_small_ops_enabled() -> bool:
    """Switched on and the extension is built."""
    return _active


def set_native_small_ops(enabled: bool) -> bool:
    """Switch the native small ops on or off (on takes effect only with the extension built);
    returns the previous switch."""
    global _switched_on, _active
    previous = _switched_on
    _switched_on = enabled
    _active = enabled and native_cpu_ops.native_available()
    return previous


set_native_small_ops(os.environ.get(ENV_VAR, "1") != "0")


@contextmanager
def native_small_ops(enabled: bool) -> Iterator[None]:
    previous = set_native_small_ops(enabled)
    try:
        yield
    finally:
        set_native_small_ops(previous)


def runs_native(*tensors: torch.Tensor) -> bool:
    """Whether the native small ops take these tensors: switched on, extension built, all on a
    CPU in one dtype the kernels support, none that autograd has to track (no backward)."""
    if not _active:
        return False
    dtype = tensors[0].dtype
    if dtype not in native_cpu_ops.NATIVE_DTYPES:
        return False
    track_grad = torch.is_grad_enabled()
    for t in tensors:  # a plain loop: this runs a few times per layer
        if not t.is_cpu or t.dtype != dtype or (track_grad and t.requires_grad):
            return False
    return True


@functools.cache
def log_native_small_ops_state() -> None:
    if _active:
        logger.info(
            "native small ops (RMSNorm, rotary, SiLU-and-mul, KV write): on for CPU float32/bfloat16 tensors"
        )
    elif not _switched_on:
        logger.info("native small ops: off (%s=0)", ENV_VAR)
    else:
        logger.info("native small ops: off (%s)", native_cpu_ops.native_unavailable_reason())
