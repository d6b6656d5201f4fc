"""Fused RMSNorm (+ residual add) and SiLU-and-mul in Triton, rounding as the torch ops do
(sums and products in fp32, rounded to the tensor dtype where torch rounds), so the fused and
unfused paths agree to the last bit in half precision up to the reduction order."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    X, R, W, Out, ResOut, stride_x, stride_r, stride_o, stride_ro, N, eps,
    HAS_RES: tl.constexpr, ROUND_NORMED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResOut + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    if ROUND_NORMED:  # half precision: normalise in fp32, round, then scale (as HF does)
        normed = normed.to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (normed * w).to(Out.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`norm(x) * weight`, or with `residual`: `(norm(x + residual) * weight, x + residual)`."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n = x2.shape[-1]
    out_dtype = torch.result_type(weight, x2) if x2.dtype != torch.float32 else torch.float32
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    res2 = residual.reshape(-1, n) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    if x2.shape[0] > 0:
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, res_out,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0), n, eps,
            HAS_RES=residual is not None, ROUND_NORMED=x2.dtype != torch.float32,
            BLOCK=triton.next_power_of_2(n), num_warps=_warps(n),
        )  # fmt: skip
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + D + cols, mask=mask, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(X.dtype.element_ty)
    out = s.to(tl.float32) * u.to(tl.float32)
    tl.store(Out + row * stride_o + cols, out.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :d]) * x[..., d:]`."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    d = x2.shape[-1] // 2
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    if x2.shape[0] > 0:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=block, num_warps=4
        )
    return out.view(*shape[:-1], d)


def _warps(n: int) -> int:
    return 8 if n >= 4096 else 4 if n >= 1024 else 2
