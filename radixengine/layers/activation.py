"""Gated activations over the fused gate/up projection: SiLU (Llama) and GELU (Gemma's GeGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.native_small_ops import runs_native
from radixengine.layers.triton_ops import use_fused_ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused_ops(x):
            from radixengine.layers.triton_ops.fused import silu_and_mul

            return silu_and_mul(x)
        if x.dim() == 2 and runs_native(x):
            return native_cpu_ops.silu_and_mul(x)
        return native_cpu_ops.silu_and_mul_reference(x)


class GeluAndMul(nn.Module):
    """`gelu(x[..., :d]) * x[..., d:]`; `approximate="tanh"`: HF's `gelu_pytorch_tanh`."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


def gelu_approximation(hidden_act: str) -> str:
    """GeluAndMul's `approximate` for an HF activation name (`gelu_pytorch_tanh`, `gelu`, ...)."""
    if hidden_act in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_tanh"):
        return "tanh"
    if hidden_act == "gelu":
        return "none"
    raise ValueError(f"unsupported gated activation {hidden_act!r}")
