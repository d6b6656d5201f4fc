"""SiLU-gated activation over the fused gate/up projection."""

from __future__ import annotations

import torch
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
