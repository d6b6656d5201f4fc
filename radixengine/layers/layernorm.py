"""RMSNorm, with the residual add of the decoder layer fused in (SGLang's form)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixengine.layers.triton_ops import use_fused_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`, or with `residual`: `(norm(x + residual), x + residual)`."""
        if use_fused_ops(x):
            from radixengine.layers.triton_ops.fused import rms_norm

            return rms_norm(x, self.weight, self.variance_epsilon, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)
        # Half precision: normalise in fp32, scale in the model dtype, as HF does.
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.variance_epsilon)
        return self.weight * normed.to(x.dtype)
