"""The batched LoRA delta on a GPU in two launches per target linear, whatever the number of
adapters in the batch (the torch forms take three or more, and a mask built per batch): a shrink
`h = x A_s^T` and an expand `y += h B_s`, each program a block of up to `block_rows` rows of one
adapter slot (the caller's block table: a power of two, at least 16, the least M a tensor-core dot
takes), reading only that slot's rank (docs/lora.md "The delta").

The pool's layout (radixengine/lora/mem_pool.py): A `[slots, R, stack, in]`, B `[slots, R, stack,
out]`, stacked module k's B in its own output columns `offsets[k] .. offsets[k + 1]`. `h` is fp32
`[rows, R * stack]`; the expand rounds it to the weights' dtype first, as the torch forms' 16-bit
product does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64
BLOCK_N = 64


@triton.jit
def _shrink_kernel(
    X, A, H, Blocks, RankOfSlot,
    stride_xt, stride_as, stride_ht, fan_in, stack,
    BLOCK_T: tl.constexpr, BLOCK_RS: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0)
    start = tl.load(Blocks + 3 * blk).to(tl.int64)
    n = tl.load(Blocks + 3 * blk + 1)
    slot = tl.load(Blocks + 3 * blk + 2).to(tl.int64)
    rank = tl.load(RankOfSlot + slot)
    t = tl.arange(0, BLOCK_T)
    t_mask = t < n
    jk = tl.arange(0, BLOCK_RS)  # A's rows j * stack + k, the slot's rank only
    jk_mask = jk < rank * stack
    acc = tl.zeros((BLOCK_T, BLOCK_RS), dtype=tl.float32)
    for k0 in range(0, fan_in, BLOCK_K):
        i = k0 + tl.arange(0, BLOCK_K)
        i_mask = i < fan_in
        x = tl.load(
            X + (start + t)[:, None] * stride_xt + i[None, :],
            mask=t_mask[:, None] & i_mask[None, :],
            other=0.0,
        )
        a = tl.load(A + slot * stride_as + jk[None, :] * fan_in + i[:, None], mask=jk_mask[None, :] & i_mask[:, None], other=0.0)  # fmt: skip
        if F32_DOT:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    tl.store(H + (start + t)[:, None] * stride_ht + jk[None, :], acc, mask=t_mask[:, None] & jk_mask[None, :])


@triton.jit
def _expand_kernel(
    H, B, Y, Blocks, RankOfSlot, Offsets,
    stride_ht, stride_bs, stride_yt, fan_out, stack,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0)
    k = tl.program_id(1)
    start = tl.load(Blocks + 3 * blk).to(tl.int64)
    n = tl.load(Blocks + 3 * blk + 1)
    slot = tl.load(Blocks + 3 * blk + 2).to(tl.int64)
    rank = tl.load(RankOfSlot + slot)
    lo = tl.load(Offsets + k)
    hi = tl.load(Offsets + k + 1)
    c = lo + tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = c < hi
    t = tl.arange(0, BLOCK_T)
    t_mask = t < n
    j = tl.arange(0, BLOCK_R)
    j_mask = j < rank
    w = tl.load(B + slot * stride_bs + (j * stack + k)[:, None] * fan_out + c[None, :], mask=j_mask[:, None] & c_mask[None, :], other=0.0)  # fmt: skip
    h = tl.load(H + (start + t)[:, None] * stride_ht + (j * stack + k)[None, :], mask=t_mask[:, None] & j_mask[None, :], other=0.0)  # fmt: skip
    if F32_DOT:
        delta = tl.dot(h.to(w.dtype).to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        delta = tl.dot(h.to(w.dtype), w)
    mask = t_mask[:, None] & c_mask[None, :]
    y_ptrs = Y + (start + t)[:, None] * stride_yt + c[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(Y.dtype.element_ty), mask=mask)


def lora_delta(
    y: torch.Tensor,
    x: torch.Tensor,
    a_buf: torch.Tensor,
    b_buf: torch.Tensor,
    blocks: torch.Tensor,
    rank_of_slot: torch.Tensor,
    offsets: torch.Tensor,
    widest_piece: int,
    block_rows: int,
) -> None:
    """`y [rows, out] += x A_s^T B_s` in place for the rows of `blocks` (int32 `[n, 3]`: first row,
    rows (at most `block_rows`), slot; an entry of no rows does nothing); `offsets` (int32, stack + 1) the stacked modules' columns on
    the device, `widest_piece` the most columns of one. Rows of unit stride; the buffers
    contiguous."""
    if blocks.shape[0] == 0:
        return
    _, max_rank, stack, fan_in = a_buf.shape
    fan_out = b_buf.shape[-1]
    h = torch.empty(x.shape[0], max_rank * stack, dtype=torch.float32, device=x.device)
    f32_dot = x.dtype == torch.float32 or not x.is_cuda  # the interpreter's dots are fp32 ones
    num_blocks = blocks.shape[0]
    _shrink_kernel[(num_blocks,)](
        x, a_buf, h, blocks, rank_of_slot,
        x.stride(0), a_buf.stride(0), h.stride(0), fan_in, stack,
        BLOCK_T=block_rows, BLOCK_RS=max(16, triton.next_power_of_2(max_rank * stack)), BLOCK_K=BLOCK_K,
        F32_DOT=f32_dot,
    )  # fmt: skip
    _expand_kernel[(num_blocks, stack, triton.cdiv(widest_piece, BLOCK_N))](
        h, b_buf, y, blocks, rank_of_slot, offsets,
        h.stride(0), b_buf.stride(0), y.stride(0), fan_out, stack,
        BLOCK_T=block_rows, BLOCK_R=max(16, triton.next_power_of_2(max_rank)), BLOCK_N=BLOCK_N,
        F32_DOT=f32_dot,
    )  # fmt: skip
