"""Attention in plain torch ops (SDPA): works on every device; the reference backend.

EXTEND runs one SDPA per request (prefix K/V gathered through `req_to_token`). DECODE splits
the batch into chunks of consecutive requests, gathers each chunk's K/V padded to its longest
request, and runs one masked SDPA per chunk: on a CPU a chunk's K/V stays in cache between the
gather and the SDPA, and uneven lengths do not pad the whole batch. On CUDA the batch is one chunk.

A decode batch whose requests share a cached prefix (the same KV slots) runs the shared-prefix
pass in plain torch instead (`native_cpu_ops.decode_attention_cascade_reference`): each shared
prefix once for all its requests' queries, merged by log-sum-exp; see `cascade_plan`.

A sliding-window layer (`RadixAttention.sliding_window_size` >= 0) gathers only the keys inside
its window and masks the rest; a soft-capped layer (`logit_cap` > 0) computes its scores
explicitly (SDPA cannot cap them). The per-request indices and masks are built once per forward
and window size, on the first layer that asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.attention.base_attn_backend import (
    AttentionBackend,
    cascade_decode,
    decode_cascade_plan,
    save_kv,
    shared_prefix_min_len,
    split_heads,
)
from radixengine.layers.attention.cascade_plan import CascadePlan

if TYPE_CHECKING:
    from radixengine.layers.forward_batch_view import AttentionLayer, ForwardBatchView


@dataclass
class _ExtendRequest:
    start: int  # first new token in the batch
    num_new: int
    # int64 [keys]: KV slots of the keys read (the sequence, or its window); None: the keys are
    # the new tokens alone.
    slots: torch.Tensor | None
    mask: torch.Tensor | None  # bool [num_new, keys]; None: plain causal over the new tokens


@dataclass
class _DecodeChunk:
    start: int  # first request of the chunk in the batch
    end: int
    # Rows of the pool viewed as [slots * kv_heads, head_dim], ordered [requests, kv_heads,
    # max_len]: one gather gives SDPA contiguous K/V. Padding points at slot 0.
    head_rows: torch.Tensor
    mask: torch.Tensor | None  # bool [requests, 1, 1, max_len]; None when nothing is padded
    max_len: int


class TorchNativeAttnBackend(AttentionBackend):
    # Decode chunk size on a CPU: padded K (or V) bytes per chunk (measured: docs/benchmarks.md).
    decode_chunk_bytes = 1 << 20
    # A request joins a chunk only if the chunk stays at least this full (real / padded tokens).
    min_padded_fill = 0.5

    def __init__(self, model_runner=None) -> None:
        self._forward_batch: ForwardBatchView | None = None
        # window size (-1: none) -> that window's requests (EXTEND) or chunks (DECODE)
        self._metadata: dict[int, list] = {}
        # Gathered K/V of one chunk at a time; reused across chunks, layers and steps (a fresh
        # large tensor per layer costs page faults on a CPU).
        self._gather_bufs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.shared_prefix_min_len = shared_prefix_min_len(model_runner)
        self.cascade_plan: CascadePlan | None = None
        self.num_shared_prefix_forwards = 0  # forwards that ran the shared-prefix pass

    def init_forward_metadata(self, forward_batch: ForwardBatchView) -> None:
        self._forward_batch = forward_batch
        self._metadata = {}
        self.cascade_plan = decode_cascade_plan(forward_batch, self.shared_prefix_min_len)
        self.num_shared_prefix_forwards += self.cascade_plan is not None

    def _metadata_for(self, window: int, forward_batch: ForwardBatchView) -> list:
        """This forward's extend requests or decode chunks for layers of `window`."""
        if forward_batch is not self._forward_batch:  # a forward that skipped init_forward_metadata
            self.init_forward_metadata(forward_batch)
        if window not in self._metadata:
            if forward_batch.forward_mode.is_decode():
                chunk_tokens = self._chunk_tokens(forward_batch)
                value = _decode_chunks(forward_batch, chunk_tokens, self.min_padded_fill, window)
            else:
                value = _extend_requests(forward_batch, window)
            self._metadata[window] = value
        return self._metadata[window]

    def _chunk_tokens(self, forward_batch: ForwardBatchView) -> int | None:
        """Padded tokens per decode chunk; None: no limit (one chunk, unless lengths are uneven)."""
        if forward_batch.input_ids.device.type != "cpu":
            return None
        k_buf = forward_batch.token_to_kv_pool.get_key_buffer(0)
        return max(1, self.decode_chunk_bytes // (k_buf[0].numel() * k_buf.element_size()))

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True) -> torch.Tensor:
        q, k, v = split_heads(q, k, v, layer)
        if save_kv_cache:
            save_kv(k, v, layer, forward_batch)
        out = torch.empty_like(q)
        pool = forward_batch.token_to_kv_pool
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        for req in self._metadata_for(layer.sliding_window_size, forward_batch):
            rows = slice(req.start, req.start + req.num_new)
            if req.slots is None:  # as stored: rounded to a 16-bit cache's precision
                ks, vs = k[rows].to(k_buf.dtype), v[rows].to(v_buf.dtype)
            else:
                ks, vs = k_buf.index_select(0, req.slots), v_buf.index_select(0, req.slots)
            out[rows] = _sdpa(
                q[rows], ks.to(q.dtype), vs.to(q.dtype), req.mask, layer.scaling, layer.logit_cap
            )
        return out.reshape(q.shape[0], -1)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True) -> torch.Tensor:
        if forward_batch is not self._forward_batch:  # a forward that skipped init_forward_metadata
            self.init_forward_metadata(forward_batch)
        plan = self.cascade_plan
        if plan is not None and layer.sliding_window_size < 0:
            # The shared-prefix pass in plain torch: the reference of the native kernel.
            kernel = native_cpu_ops.decode_attention_cascade_reference
            return cascade_decode(kernel, (q, k, v), layer, forward_batch, save_kv_cache, plan)
        q, k, v = split_heads(q, k, v, layer)
        if save_kv_cache:
            save_kv(k, v, layer, forward_batch)
        bs, num_kv, dim = q.shape[0], layer.tp_k_head_num, layer.qk_head_dim
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        k_rows, v_rows = k_buf.view(-1, dim), v_buf.view(-1, dim)
        # GQA as a batch of [group, dim] queries per KV head: no K/V repeat, SDPA's flash path.
        q = q.view(bs, num_kv, -1, dim)
        chunks = self._metadata_for(layer.sliding_window_size, forward_batch)
        if len(chunks) == 1:
            return self._decode_chunk(q, k_rows, v_rows, chunks[0], layer).reshape(bs, -1)
        out = torch.empty_like(q)
        for chunk in chunks:
            out[chunk.start : chunk.end] = self._decode_chunk(q, k_rows, v_rows, chunk, layer)
        return out.reshape(bs, -1)

    def _decode_chunk(self, q, k_rows, v_rows, chunk: _DecodeChunk, layer: AttentionLayer) -> torch.Tensor:
        ks, vs = self._gather(k_rows, v_rows, chunk.head_rows)
        shape = (chunk.end - chunk.start, q.shape[1], chunk.max_len, q.shape[3])
        q, ks, vs = q[chunk.start : chunk.end], ks.view(shape).to(q.dtype), vs.view(shape).to(q.dtype)
        if layer.logit_cap > 0:
            return capped_attention(q, ks, vs, chunk.mask, layer.scaling, layer.logit_cap)
        return F.scaled_dot_product_attention(q, ks, vs, attn_mask=chunk.mask, scale=layer.scaling)

    def _gather(self, k_rows: torch.Tensor, v_rows: torch.Tensor, rows: torch.Tensor):
        """`k_rows[rows]` and `v_rows[rows]`, written into buffers reused across layers and
        steps (a fresh large tensor per layer costs page faults on a CPU)."""
        numel = rows.numel() * k_rows.shape[1]
        bufs = self._gather_bufs
        if (
            bufs is None
            or bufs[0].numel() < numel
            or bufs[0].dtype != k_rows.dtype
            or bufs[0].device != k_rows.device
        ):
            bufs = tuple(torch.empty(numel, dtype=k_rows.dtype, device=k_rows.device) for _ in "kv")
            self._gather_bufs = bufs
        shape = (rows.numel(), k_rows.shape[1])
        ks, vs = bufs[0][:numel].view(shape), bufs[1][:numel].view(shape)
        torch.index_select(k_rows, 0, rows, out=ks)
        torch.index_select(v_rows, 0, rows, out=vs)
        return ks, vs


def _sdpa(q, k, v, mask, scale, logit_cap: float = 0.0) -> torch.Tensor:
    """q `[n, H, D]`, k/v `[s, Hkv, D]` -> `[n, H, D]`; causal when `mask` is None (n == s).
    4-D inputs: SDPA's CPU flash kernel takes only those (3-D falls back to the math path)."""
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if logit_cap > 0:
        if mask is None:
            mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril_()
        group = q.shape[1] // k.shape[1]
        k4, v4 = k4.repeat_interleave(group, dim=1), v4.repeat_interleave(group, dim=1)
        return capped_attention(q4, k4, v4, mask, scale, logit_cap)[0].transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q4, k4, v4, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out[0].transpose(0, 1)


def capped_attention(q, k, v, mask, scale: float, logit_cap: float) -> torch.Tensor:
    """Attention with soft-capped scores, `cap * tanh(q.k * scale / cap)`, as HF's Gemma 2 eager
    attention computes it. q `[..., n, D]`, k/v `[..., s, D]` (same heads), mask bool
    `[..., n, s]` (True: visible) or None."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / logit_cap) * logit_cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _extend_requests(fb: ForwardBatchView, window: int) -> list[_ExtendRequest]:
    device = fb.input_ids.device
    max_len = max(fb.seq_lens_cpu, default=0)
    table = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_len].to(torch.int64)
    reqs, start = [], 0
    for i, (prefix, num_new) in enumerate(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
        seq_len = prefix + num_new
        first_key = max(0, prefix - window) if window >= 0 else 0
        slots = None if first_key == prefix else table[i, first_key:seq_len]
        mask = None
        if slots is not None or (window >= 0 and num_new > window + 1):
            query_pos = torch.arange(prefix, seq_len, device=device)[:, None]
            key_pos = torch.arange(first_key, seq_len, device=device)[None, :]
            mask = key_pos <= query_pos
            if window >= 0:
                mask &= key_pos >= query_pos - window
        reqs.append(_ExtendRequest(start, num_new, slots, mask))
        start += num_new
    return reqs


def _decode_chunks(
    fb: ForwardBatchView, chunk_tokens: int | None, min_fill: float, window: int
) -> list[_DecodeChunk]:
    """Chunks of the batch's requests; a request's keys are its whole sequence, or with a window
    its last `window + 1` positions."""
    seq_lens = fb.seq_lens_cpu
    firsts = [max(0, n - 1 - window) for n in seq_lens] if window >= 0 else [0] * len(seq_lens)
    lens = [n - f for n, f in zip(seq_lens, firsts)]
    table = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, : max(seq_lens)].to(torch.int64)
    num_kv = fb.token_to_kv_pool.get_key_buffer(0).shape[1]
    bounds, start, longest, total = [], 0, 0, 0
    for i, n in enumerate(lens):
        padded = (i - start + 1) * max(longest, n)
        fits = chunk_tokens is None or padded <= chunk_tokens
        if i > start and not (fits and total + n >= min_fill * padded):
            bounds.append((start, i))
            start, longest, total = i, 0, 0
        longest, total = max(longest, n), total + n
    bounds.append((start, len(lens)))
    return [_decode_chunk(fb, table, num_kv, lo, hi, firsts, lens) for lo, hi in bounds]


def _decode_chunk(
    fb: ForwardBatchView,
    table: torch.Tensor,
    num_kv: int,
    start: int,
    end: int,
    firsts: list[int],
    lens: list[int],
) -> _DecodeChunk:
    max_len = max(lens[start:end])
    device = table.device
    if any(firsts[start:end]):
        cols = torch.tensor(firsts[start:end], device=device)[:, None] + torch.arange(max_len, device=device)
        slots = table[start:end].gather(1, cols.clamp_(max=table.shape[1] - 1))
    else:
        slots = table[start:end, :max_len]
    mask = None
    if min(lens[start:end]) != max_len:  # equal lengths need no mask (SDPA's faster unmasked path)
        chunk_lens = (
            torch.tensor(lens[start:end], device=device) if any(firsts[start:end]) else fb.seq_lens[start:end]
        )
        valid = torch.arange(max_len, device=device)[None, :] < chunk_lens[:, None]
        slots = torch.where(valid, slots, 0)
        mask = valid[:, None, None, :]
    heads = torch.arange(num_kv, device=device)
    head_rows = (slots[:, None, :] * num_kv + heads[None, :, None]).reshape(-1)
    return _DecodeChunk(start, end, head_rows, mask, max_len)
