"""Triton kernels for the CUDA path: decode attention over `req_to_token`, fused RMSNorm (+
residual add) and SiLU-and-mul. Imported lazily: Triton is optional (the CPU path never needs it).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _enabled(interpret_only: bool) -> bool:
    if os.environ.get("RADIXENGINE_DISABLE_FUSED_OPS"):
        return False
    if interpret_only and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return triton_available()


def use_fused_ops(x: torch.Tensor) -> bool:
    """The fused Triton small ops run for CUDA tensors when Triton is installed (and
    RADIXENGINE_DISABLE_FUSED_OPS is unset); on the CPU only under TRITON_INTERPRET=1."""
    return _enabled(not x.is_cuda)
