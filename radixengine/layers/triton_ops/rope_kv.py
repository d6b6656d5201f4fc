"""Rotary embedding in place, with the K/V write into the pool in the same launch (the torch forms
take seven and two), and the K/V write alone: the CUDA decode step's floor is its launch count.

Rounding as the torch ops do in half precision: each product rounded to the tensor dtype, then
the sum, so the fused and unfused paths agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_store_kv_kernel(
    X, Pos, CosSin, V, KBuf, VBuf, Loc,
    stride_xt, stride_xh, stride_cs, stride_vt, stride_vh, stride_kbt, stride_kbh, stride_vbt, stride_vbh,
    num_heads, num_q_heads, head_size, v_head_dim,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, STORE_KV: tl.constexpr,
    BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
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
    o1 = ((x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)).to(dt)
    tl.store(ptrs, o1, mask=mask)
    tl.store(ptrs + HALF, o2, mask=mask)
    if STORE_KV:
        loc = tl.load(Loc + t).to(tl.int64)
        kdt = KBuf.dtype.element_ty
        # The k heads' rotated halves from registers (not read back: other threads wrote them).
        k_mask = mask & (h >= num_q_heads)[:, None]
        kv_h = tl.maximum(h - num_q_heads, 0)
        k_ptrs = KBuf + loc * stride_kbt + kv_h[:, None] * stride_kbh + r[None, :]
        tl.store(k_ptrs, o1.to(kdt), mask=k_mask)
        tl.store(k_ptrs + HALF, o2.to(kdt), mask=k_mask)
        k_row, v_row = X + t * stride_xt + num_q_heads * stride_xh, V + t * stride_vt
        kv_heads = num_heads - num_q_heads
        _store_k_tail_and_v(
            k_row, v_row, KBuf + loc * stride_kbt, VBuf + loc * stride_vbt,
            stride_xh, stride_vh, stride_kbh, stride_vbh, kv_heads, head_size, v_head_dim,
            2 * HALF, BLOCK_KV, BLOCK_D, BLOCK_DV,
        )  # fmt: skip


@triton.jit
def _store_k_tail_and_v(
    KRow, VRow, KBufRow, VBufRow, stride_kh, stride_vh, stride_kbh, stride_vbh,
    kv_heads, head_size, v_head_dim,
    ROTARY_DIM: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """A token's k heads' dims past the rotary ones (partial rotary), as they are, and its v."""
    g = tl.arange(0, BLOCK_KV)
    g_mask = g < kv_heads
    d = tl.arange(0, BLOCK_D)
    tail = g_mask[:, None] & ((d >= ROTARY_DIM) & (d < head_size))[None, :]
    k_tail = tl.load(KRow + g[:, None] * stride_kh + d[None, :], mask=tail)
    tl.store(KBufRow + g[:, None] * stride_kbh + d[None, :], k_tail.to(KBufRow.dtype.element_ty), mask=tail)
    dv = tl.arange(0, BLOCK_DV)
    v_mask = g_mask[:, None] & (dv < v_head_dim)[None, :]
    v = tl.load(VRow + g[:, None] * stride_vh + dv[None, :], mask=v_mask)
    tl.store(VBufRow + g[:, None] * stride_vbh + dv[None, :], v.to(VBufRow.dtype.element_ty), mask=v_mask)


def rotary_in_place(
    positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    """Rotate the first `rotary_dim` dims of every head of `x` `[tokens, heads, head_size]`
    (unit stride within a head) at `positions`, in place, with the neox-style `cos_sin`
    `[max_position, rotary_dim]` (cos | sin halves); returns `x`."""
    return _rope(positions, x, cos_sin, rotary_dim, None)


def rotary_store_kv(
    positions: torch.Tensor,
    x: torch.Tensor,
    cos_sin: torch.Tensor,
    rotary_dim: int,
    v: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    loc: torch.Tensor,
) -> torch.Tensor:
    """`rotary_in_place`, and in the same launch `k_buf[loc] = k; v_buf[loc] = v` (cast to the
    pool's dtype), k being the last `v.shape[1]` heads of `x` once rotated; `v`
    `[tokens, kv_heads, v_head_dim]` and the buffers have unit stride within a head."""
    return _rope(positions, x, cos_sin, rotary_dim, (v, k_buf, v_buf, loc))


def _rope(positions, x, cos_sin, rotary_dim, kv: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    tokens, heads, head_size = x.shape
    if not tokens:
        return x
    v, k_buf, v_buf, loc = kv or (x, x, x, positions)  # unread without the K/V write
    kv_heads = v.shape[1] if kv else 1
    _rope_store_kv_kernel[(tokens,)](
        x, positions, cos_sin, v, k_buf, v_buf, loc,
        x.stride(0), x.stride(1), cos_sin.stride(0), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        heads, heads - kv_heads, head_size, v.shape[2],
        HALF=rotary_dim // 2, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_R=triton.next_power_of_2(rotary_dim // 2), STORE_KV=kv is not None,
        BLOCK_KV=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_size),
        BLOCK_DV=triton.next_power_of_2(v.shape[2]),
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
