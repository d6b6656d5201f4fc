"""Rotary embedding in place and the K/V write into the pool, one Triton launch each (the torch
forms take seven and two): the CUDA decode step's floor is its launch count.

Rounding as the torch ops do in half precision: each product rounded to the tensor dtype, then
the sum, so the fused and unfused paths agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    X, Pos, CosSin, stride_xt, stride_xh, stride_cs, num_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < HALF
    cos = tl.load(CosSin + pos * stride_cs + r, mask=r_mask, other=0.0).to(tl.float32)
    sin = tl.load(CosSin + pos * stride_cs + HALF + r, mask=r_mask, other=0.0).to(tl.float32)
    h = tl.arange(0, BLOCK_H)
    mask = (h < num_heads)[:, None] & r_mask[None, :]
    ptrs = X + t * stride_xt + h[:, None] * stride_xh + r[None, :]
    dt = X.dtype.element_ty
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)
    o2 = (x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)
    tl.store(ptrs, o1.to(dt), mask=mask)
    tl.store(ptrs + HALF, o2.to(dt), mask=mask)


def rotary_in_place(
    positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    """Rotate the first `rotary_dim` dims of every head of `x` `[tokens, heads, head_size]`
    (unit stride within a head) at `positions`, in place, with the neox-style `cos_sin`
    `[max_position, rotary_dim]` (cos | sin halves); returns `x`."""
    tokens, heads, _ = x.shape
    half = rotary_dim // 2
    if tokens:
        _rotary_kernel[(tokens,)](
            x, positions, cos_sin, x.stride(0), x.stride(1), cos_sin.stride(0), heads,
            HALF=half, BLOCK_H=triton.next_power_of_2(heads), BLOCK_R=triton.next_power_of_2(half),
        )  # fmt: skip
    return x


@triton.jit
def _store_kv_kernel(
    K, V, KBuf, VBuf, Loc, stride_k, stride_v, stride_kb, stride_vb, N, BLOCK: tl.constexpr
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    loc = tl.load(Loc + t).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    k = tl.load(K + t * stride_k + cols, mask=mask, other=0.0)
    v = tl.load(V + t * stride_v + cols, mask=mask, other=0.0)
    tl.store(KBuf + loc * stride_kb + cols, k.to(KBuf.dtype.element_ty), mask=mask)
    tl.store(VBuf + loc * stride_vb + cols, v.to(VBuf.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor
) -> None:
    """`k_buf[loc] = k; v_buf[loc] = v` (cast to the pool's dtype) in one launch; k and v are
    `[tokens, heads, head_dim]` whose token rows are contiguous."""
    n = k.shape[1] * k.shape[2]
    if k.shape[0]:
        _store_kv_kernel[(k.shape[0],)](
            k, v, k_buf, v_buf, loc, k.stride(0), v.stride(0), k_buf.stride(0), v_buf.stride(0), n,
            BLOCK=triton.next_power_of_2(n),
        )  # fmt: skip
