"""Decode attention over the paged KV pool, read through `req_to_token` (split-KV, two stages).

Stage 1: program (request, KV head, split) walks its share of the request's tokens, gathering
K/V blocks by slot once for all the query heads of that KV head (GQA: the group's scores are one
`tl.dot`), and writes each head's partial output and log-sum-exp. Stage 2 merges the splits.
Dots on fp32 inputs are exact fp32 (not TF32); in Triton's interpreter (a CPU) every dot runs in
fp32 (its 16-bit dots are wrong, Triton 3.9).
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
    KV_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, F32_DOT: tl.constexpr, DIRECT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kv_h = tl.program_id(1)
    s = tl.program_id(2)
    heads = kv_h * KV_GROUP + tl.arange(0, BLOCK_G)
    g_mask = tl.arange(0, BLOCK_G) < KV_GROUP
    start, end = _split_range(SeqLens, b, s, window_left, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_ptrs = Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    kv_row = ReqToToken + tl.load(ReqPoolIdx + b).to(tl.int64) * stride_r2t
    acc, m_i, l_i = _attend_split(
        q, K + kv_h * stride_kh + d[None, :], V + kv_h * stride_vh + d[None, :], kv_row,
        stride_kt, stride_vt, d_mask, start, end, scale, logit_cap, BLOCK_G, BLOCK_D, BLOCK_N, F32_DOT,
    )  # fmt: skip
    mid = MidO + b * stride_mb + heads[:, None] * stride_mh + s * stride_ms + d[None, :]
    lse_at = MidLse + b * (stride_mb // stride_ms) + heads * NUM_SPLITS + s
    if end > start:
        out = (acc / l_i[:, None]).to(MidO.dtype.element_ty)
        tl.store(mid, out, mask=g_mask[:, None] & d_mask[None, :])
        if not DIRECT:
            tl.store(lse_at, m_i + tl.log(l_i), mask=g_mask)
    elif not DIRECT:
        tl.store(lse_at, tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf"), mask=g_mask)


@triton.jit
def _attend_split(
    q, K, V, kv_row, stride_kt, stride_vt, d_mask, start, end, scale, logit_cap,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    """Online softmax of a KV group's query heads over positions [start, end): each K/V block is
    read once for the whole group. Returns (acc, running max, row sums)."""
    m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs < end
        slots = tl.load(kv_row + offs, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + slots[:, None] * stride_kt, mask=kv_mask, other=0.0)
        if F32_DOT:
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k.to(q.dtype)))
        qk = qk * scale
        if logit_cap > 0:
            qk = logit_cap * (2.0 * tl.sigmoid(2.0 * qk / logit_cap) - 1.0)  # cap * tanh(qk / cap)
        qk = tl.where(n_mask[None, :], qk, -float("inf"))
        m_new = tl.maximum(tl.max(qk, 1), m_i)
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
    return acc, m_i, l_i


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
    out = torch.empty_like(q) if out is None else out
    direct = num_splits == 1  # one split: stage 1 writes the output, no stage 2
    mid_o, mid_lse, mid_strides = _split_buffers(out, num_splits)
    group = num_heads // num_kv
    _decode_stage1[(bs, num_kv, num_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0), *mid_strides,
        scale, window_left, float(logit_cap),
        KV_GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=max(16, block_d), BLOCK_N=max(16, block_n), NUM_SPLITS=num_splits,
        F32_DOT=q.dtype == torch.float32 or not q.is_cuda, DIRECT=direct,
    )  # fmt: skip
    if direct:
        return out
    _decode_stage2[(bs, num_heads)](
        mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
    )  # fmt: skip
    return out


def _split_buffers(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Stage 1's partial outputs and log-sum-exps, and the partials' (request, head, split)
    strides; with one split the output itself (no log-sum-exp is written)."""
    if num_splits == 1:
        return out, out, (out.stride(0), out.stride(1), 1)
    bs, num_heads, head_dim = out.shape
    mid_o = torch.empty((bs, num_heads, num_splits, head_dim), dtype=torch.float32, device=out.device)
    mid_lse = torch.empty((bs, num_heads, num_splits), dtype=torch.float32, device=out.device)
    return mid_o, mid_lse, mid_o.stride()[:3]


def decode_num_splits(batch_size: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Splits of each request's KV: enough programs (batch x KV heads x splits) for two per
    streaming multiprocessor, a power of two up to `max_splits`; 1 when the batch alone fills
    the GPU (stage 1 then writes the output and stage 2 is not launched). From the batch size
    alone, so the CUDA graph captured for a batch size keeps its split count."""
    want = -(-2 * num_sms // max(1, batch_size * num_kv_heads))
    return min(max_splits, triton.next_power_of_2(want)) if want > 1 else 1
