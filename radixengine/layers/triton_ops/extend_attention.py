"""Extend (prefill) attention for a whole batch in one launch, over the paged KV pool.

Each request's new tokens attend to its cached prefix and, causally, to each other; both are
read from the pool through `req_to_token` (the new tokens' K/V are written there first), so a
prefix may start or end anywhere in a page and the page size does not matter. Program
(request, q head, block of BLOCK_M new tokens) runs an online softmax over the keys its block
can see: from the window's first position (`window_left` >= 0: keys `pos - window_left ..
pos`) or 0, up to its last query's position. GQA: head h reads KV head `h // group`.
`logit_cap` > 0 soft-caps the scores (`cap * tanh(score / cap)`).

The grid is (batch, heads, blocks of the longest extend): the host knows the extend lengths
(`extend_seq_lens_cpu`), so building it reads nothing from the device; programs past their
request's length return at once. Like SGLang's `extend_attention.py` in what it computes; unlike
it, one loop reads prefix and new keys alike from the pool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NO_SCORE: tl.constexpr = tl.constexpr(
    -1.0e30
)  # a finite "minus infinity": a fully masked block leaves exp(...) at 0, not NaN


@triton.jit
def _extend_attention(
    Q, K, V, Out, ReqToToken, ReqPoolIdx, PrefixLens, ExtendLens, QStart,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_r2t, scale, window_left, logit_cap,
    KV_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    num_new = tl.load(ExtendLens + b).to(tl.int32)
    if mb * BLOCK_M >= num_new:
        return
    prefix = tl.load(PrefixLens + b).to(tl.int32)
    m_offs = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m_offs < num_new
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_rows = tl.load(QStart + b).to(tl.int64) + m_offs
    qo_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + d[None, :], mask=qo_mask, other=0.0)
    kv_offs = (h // KV_GROUP) * stride_kh + d[None, :]
    kv_row = ReqToToken + tl.load(ReqPoolIdx + b).to(tl.int64) * stride_r2t
    acc, l_i = _attend_block(
        q, prefix + m_offs, m_mask, K + kv_offs, V + kv_offs, kv_row, stride_kt, stride_vt, d_mask,
        prefix + mb * BLOCK_M, prefix + tl.minimum(mb * BLOCK_M + BLOCK_M, num_new) - 1,
        scale, window_left, logit_cap, BLOCK_M, BLOCK_D, BLOCK_N, F32_DOT,
    )  # fmt: skip
    out = acc / tl.where(m_mask, l_i, 1.0)[:, None]
    o_ptrs = Out + q_rows[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=qo_mask)


@triton.jit
def _attend_block(
    q, q_pos, m_mask, K, V, kv_row, stride_kt, stride_vt, d_mask, first_pos, last_pos,
    scale, window_left, logit_cap,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    """Online softmax of a block of queries over the keys it can see: (acc, row sums)."""
    lo = tl.where(window_left >= 0, tl.maximum(first_pos - window_left, 0), 0)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + _NO_SCORE
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(lo, last_pos + 1, BLOCK_N):
        n_offs = n0 + tl.arange(0, BLOCK_N)
        n_mask = n_offs <= last_pos
        slots = tl.load(kv_row + n_offs, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + slots[:, None] * stride_kt, mask=kv_mask, other=0.0)
        qk = _scores(q, k, scale, logit_cap, F32_DOT)
        visible = (n_offs[None, :] <= q_pos[:, None]) & n_mask[None, :] & m_mask[:, None]
        if window_left >= 0:
            visible = visible & (n_offs[None, :] >= q_pos[:, None] - window_left)
        qk = tl.where(visible, qk, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        v = tl.load(V + slots[:, None] * stride_vt, mask=kv_mask, other=0.0)
        if F32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return acc, l_i


@triton.jit
def _scores(q, k, scale, logit_cap, F32_DOT: tl.constexpr):
    """q.k * scale, soft-capped when `logit_cap` > 0 (`cap * tanh(score / cap)`)."""
    if F32_DOT:
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k.to(q.dtype)))
    qk = qk * scale
    if logit_cap > 0:
        qk = logit_cap * (2.0 * tl.sigmoid(2.0 * qk / logit_cap) - 1.0)
    return qk


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    q_starts: torch.Tensor,
    max_extend_len: int,
    scale: float,
    window_left: int = -1,
    logit_cap: float = 0.0,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """q `[num_new_tokens, H, D]`, the requests' new tokens back to back (request i's start at
    `q_starts[i]`); K/V pools `[slots, Hkv, D]` already holding the new tokens' K/V;
    `prefix_lens`, `extend_lens`, `q_starts`, `req_pool_indices`: device tensors `[bs]`;
    `max_extend_len`: the longest extend, known on the host. Returns `[num_new_tokens, H, D]`."""
    num_tokens, num_heads, head_dim = q.shape
    bs = req_pool_indices.shape[0]
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0 or bs == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    tile = _tile(q, block_d)
    block_m = block_m or tile
    block_n = block_n or tile
    grid = (bs, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_attention[grid](
        q, k_buffer, v_buffer, out, req_to_token, req_pool_indices, prefix_lens, extend_lens, q_starts,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0), scale, window_left, float(logit_cap),
        KV_GROUP=num_heads // k_buffer.shape[1], HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=block_n, F32_DOT=q.dtype == torch.float32 or not q.is_cuda,
    )  # fmt: skip
    return out


def _tile(q: torch.Tensor, block_d: int) -> int:
    """64 x 64 tiles where a head row is at most 256 bytes (bf16 up to 128 dims, fp32 up to 64):
    q, K and V tiles then fit in shared memory with the loop's pipelining; 32 above; 16 in the
    interpreter (a CPU), where smaller tiles run faster."""
    if not q.is_cuda:
        return 16
    return 64 if block_d * q.element_size() <= 256 else 32
