"""Decode attention over the paged KV pool, read through `req_to_token` (split-KV, two stages).

Stage 1: program (request, q head, split) walks its share of the request's tokens, gathering
K/V rows by slot, and writes a partial output and its log-sum-exp. Stage 2 merges the splits.
The grid depends only on the batch size, so the kernels are CUDA-graph safe: sequence lengths
are read on the device. A sliding window (`window_left` >= 0) splits only the last
`window_left + 1` positions; `logit_cap` > 0 soft-caps the scores (`cap * tanh(score / cap)`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_stage1(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, MidO, MidLse,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
    stride_mb, stride_mh, stride_ms,
    scale, window_left, logit_cap,
    KV_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    kv_h = h // KV_GROUP
    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    start, end = _split_range(SeqLens, b, s, window_left, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + h * stride_qh + d, mask=d_mask, other=0.0).to(tl.float32)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs < end
        slots = tl.load(ReqToToken + row * stride_r2t + offs, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + slots[:, None] * stride_kt + kv_h * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        qk = tl.sum(q[None, :] * k.to(tl.float32), 1) * scale
        if logit_cap > 0:
            qk = logit_cap * (2.0 * tl.sigmoid(2.0 * qk / logit_cap) - 1.0)  # cap * tanh(qk / cap)
        qk = tl.where(n_mask, qk, -float("inf"))
        m_new = tl.maximum(tl.max(qk, 0), m_i)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new)
        v = tl.load(V + slots[:, None] * stride_vt + kv_h * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    mid = b * stride_mb + h * stride_mh + s * stride_ms
    lse_at = MidLse + b * (stride_mb // stride_ms) + h * NUM_SPLITS + s
    _store_split(MidO + mid + d, lse_at, acc, m_i, l_i, d_mask, end > start)


@triton.jit
def _split_range(SeqLens, b, s, window_left, NUM_SPLITS: tl.constexpr):
    """Split `s`'s positions [start, end) of request `b` (within its window, if any)."""
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    first = tl.where(window_left >= 0, tl.maximum(seq_len - 1 - window_left, 0), 0)
    split_len = tl.cdiv(seq_len - first, NUM_SPLITS)
    start = first + s * split_len
    end = tl.minimum(start + split_len, seq_len)
    return start, end


@triton.jit
def _store_split(o_ptrs, lse_ptr, acc, m_i, l_i, d_mask, nonempty):
    """A split's partial output and log-sum-exp; an empty split's log-sum-exp is -inf."""
    if nonempty:
        tl.store(o_ptrs, acc / l_i, mask=d_mask)
        tl.store(lse_ptr, m_i + tl.log(l_i))
    else:
        tl.store(lse_ptr, -float("inf"))


@triton.jit
def _decode_stage2(
    MidO, MidLse, Out, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    lse = tl.load(MidLse + b * (stride_mb // stride_ms) + h * NUM_SPLITS + s)
    m = tl.max(lse, 0)
    w = tl.exp(lse - m)  # empty splits: exp(-inf) = 0
    o_ptrs = MidO + b * stride_mb + h * stride_mh + s[:, None] * stride_ms + d[None, :]
    o = tl.load(o_ptrs, mask=(w[:, None] > 0) & d_mask[None, :], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_mask)


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int = 16,
    block_n: int = 32,
    out: torch.Tensor | None = None,
    window_left: int = -1,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """q `[bs, H, D]`; K/V pools `[slots, Hkv, D]`; `seq_lens` includes the new token (whose K/V
    is already in the pool). Returns `[bs, H, D]` in q's dtype."""
    bs, num_heads, head_dim = q.shape
    num_kv = k_buffer.shape[1]
    block_d = triton.next_power_of_2(head_dim)
    mid_o = torch.empty((bs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((bs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q) if out is None else out
    _decode_stage1[(bs, num_heads, num_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        scale, window_left, float(logit_cap),
        KV_GROUP=num_heads // num_kv, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=block_n, NUM_SPLITS=num_splits,
    )  # fmt: skip
    _decode_stage2[(bs, num_heads)](
        mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
    )  # fmt: skip
    return out
