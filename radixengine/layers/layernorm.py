"""RMSNorm, with the residual add of the decoder layer fused in (SGLang's form); Gemma's variant."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.native_small_ops import log_native_small_ops_state, runs_native
from radixengine.layers.triton_ops import use_fused_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        log_native_small_ops_state()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`, or with `residual`: `(norm(x + residual), x + residual)`.

        With `residual` on the native CPU path the results are written in place, into `x` (the
        norm) and `residual` (the sum), which are returned (SGLang's fused_add_rmsnorm): callers
        pass tensors they no longer need, as the decoder layers do."""
        if use_fused_ops(x):
            from radixengine.layers.triton_ops.fused import rms_norm

            return rms_norm(x, self.weight, self.variance_epsilon, residual)
        if residual is None:
            if runs_native(x, self.weight):
                return self._native_norm(x)
            return self._norm(x)
        if runs_native(x, residual, self.weight) and _fusable_in_place(x, residual):
            native_cpu_ops.fused_add_rms_norm(_rows(x), _rows(residual), self.weight, self.variance_epsilon)
            return x, residual
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return native_cpu_ops.rms_norm_reference(x, self.weight, self.variance_epsilon)

    def _native_norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return native_cpu_ops.rms_norm(x, self.weight, self.variance_epsilon)
        rows = x.reshape(-1, x.shape[-1])
        return native_cpu_ops.rms_norm(rows, self.weight, self.variance_epsilon).view(x.shape)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scaled by `1 + weight` (the checkpoint stores the offset), computed in
    float32 and rounded to the input's dtype once, as HF does."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.data.zero_()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = residual = x + residual
        scale = self.weight.float() + 1.0
        out = F.rms_norm(x.float(), (x.shape[-1],), scale, self.variance_epsilon).to(x.dtype)
        return out if residual is None else (out, residual)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`[tokens, hidden]` as the kernels take it (a view; 2-D tensors as they are: a view costs
    microseconds, as much as the op at batch 1)."""
    return x if x.dim() == 2 else x.view(-1, x.shape[-1])


def _fusable_in_place(x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Rows the in-place kernel can take: same shape, contiguous, not the same memory."""
    return (
        x.shape == residual.shape
        and x.is_contiguous()
        and residual.is_contiguous()
        and x.data_ptr() != residual.data_ptr()
    )
