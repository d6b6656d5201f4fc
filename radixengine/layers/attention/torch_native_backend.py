"""Attention in plain torch ops (SDPA): works on every device; the reference backend.

EXTEND runs one SDPA per request (prefix K/V gathered through `req_to_token`). DECODE gathers
every request's K/V into one padded batch and runs a single masked SDPA per layer; when padding
would be most of that batch (very uneven lengths), it runs one SDPA per request instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixengine.layers.attention.base_attn_backend import AttentionBackend, save_kv

if TYPE_CHECKING:
    from radixengine.layers.radix_attention import RadixAttention
    from radixengine.model_executor.forward_batch_info import ForwardBatch


@dataclass
class _ExtendRequest:
    start: int  # first new token in the batch
    num_new: int
    slots: torch.Tensor | None  # int64 [seq_len]: KV slots of the whole sequence; None: no prefix
    mask: torch.Tensor | None  # bool [num_new, seq_len] (causal, offset by the prefix)


@dataclass
class _DecodeMetadata:
    # Rows of the pool viewed as [slots * kv_heads, head_dim], ordered [bs, kv_heads, max_len]:
    # one gather gives SDPA contiguous K/V. Padding points at slot 0.
    head_rows: torch.Tensor | None
    mask: torch.Tensor | None  # bool [bs, 1, 1, max_len]; None when no request is padded
    max_len: int
    # Uneven batches: (head rows [kv_heads * seq_len], seq_len) per request, no padding.
    per_request: list[tuple[torch.Tensor, int]] | None = None


class TorchNativeAttnBackend(AttentionBackend):
    # Decode pads the batch to its longest request unless the real tokens fill less than this
    # share of the padded batch; then it loops over requests. With one CPU thread the loop is
    # also faster for even batches (each request's K/V stays in cache between gather and SDPA);
    # with more threads the padded batch parallelises better (measured: docs/benchmarks.md).
    min_padded_fill = 0.5
    min_padded_fill_one_thread = 2.0

    def __init__(self, model_runner=None) -> None:
        self.extend_requests: list[_ExtendRequest] = []
        self.decode_metadata: _DecodeMetadata | None = None
        # Gathered K/V of one layer at a time; reused across layers and steps (a fresh large
        # tensor per layer costs page faults on a CPU).
        self._gather_bufs: tuple[torch.Tensor, torch.Tensor] | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.forward_mode.is_decode():
            self.decode_metadata = _decode_metadata(forward_batch, self._min_padded_fill(forward_batch))
        elif forward_batch.forward_mode.is_extend():
            self.extend_requests = _extend_requests(forward_batch)

    def _min_padded_fill(self, forward_batch: ForwardBatch) -> float:
        one_cpu_thread = forward_batch.input_ids.device.type == "cpu" and torch.get_num_threads() == 1
        return self.min_padded_fill_one_thread if one_cpu_thread else self.min_padded_fill

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True) -> torch.Tensor:
        q, k, v = _heads(q, k, v, layer)
        if save_kv_cache:
            save_kv(k, v, layer, forward_batch)
        out = torch.empty_like(q)
        pool = forward_batch.token_to_kv_pool
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        for req in self.extend_requests:
            rows = slice(req.start, req.start + req.num_new)
            if req.slots is None:
                ks, vs = k[rows], v[rows]
            else:
                ks, vs = k_buf.index_select(0, req.slots), v_buf.index_select(0, req.slots)
            out[rows] = _sdpa(q[rows], ks, vs, req.mask, layer.scaling)
        return out.view(q.shape[0], -1)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True) -> torch.Tensor:
        q, k, v = _heads(q, k, v, layer)
        if save_kv_cache:
            save_kv(k, v, layer, forward_batch)
        meta = self.decode_metadata
        bs, num_kv, dim = q.shape[0], layer.tp_k_head_num, layer.qk_head_dim
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        k_rows, v_rows = k_buf.view(-1, dim), v_buf.view(-1, dim)
        # GQA as a batch of [group, dim] queries per KV head: no K/V repeat, SDPA's flash path.
        q = q.view(bs, num_kv, -1, dim)
        if meta.per_request is not None:
            out = torch.empty_like(q)
            for i, (rows, seq_len) in enumerate(meta.per_request):
                ks, vs = self._gather(k_rows, v_rows, rows)
                shape = (1, num_kv, seq_len, dim)
                out[i] = F.scaled_dot_product_attention(
                    q[i : i + 1], ks.view(shape), vs.view(shape), scale=layer.scaling
                )[0]
            return out.view(bs, -1)
        ks, vs = self._gather(k_rows, v_rows, meta.head_rows)
        shape = (bs, num_kv, meta.max_len, dim)
        out = F.scaled_dot_product_attention(
            q, ks.view(shape), vs.view(shape), attn_mask=meta.mask, scale=layer.scaling
        )
        return out.reshape(bs, -1)

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


def _heads(q, k, v, layer: RadixAttention):
    return (
        q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
        k.view(-1, layer.tp_k_head_num, layer.qk_head_dim),
        v.view(-1, layer.tp_v_head_num, layer.v_head_dim),
    )


def _sdpa(q, k, v, mask, scale) -> torch.Tensor:
    """q `[n, H, D]`, k/v `[s, Hkv, D]` -> `[n, H, D]`; causal when `mask` is None (n == s).
    4-D inputs: SDPA's CPU flash kernel takes only those (3-D falls back to the math path)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


def _extend_requests(fb: ForwardBatch) -> list[_ExtendRequest]:
    device = fb.input_ids.device
    max_len = max(fb.seq_lens_cpu, default=0)
    table = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_len].to(torch.int64)
    reqs, start = [], 0
    for i, (prefix, num_new) in enumerate(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
        slots = mask = None
        if prefix > 0:
            seq_len = prefix + num_new
            slots = table[i, :seq_len]
            cols = torch.arange(seq_len, device=device)
            mask = cols[None, :] <= (prefix + torch.arange(num_new, device=device))[:, None]
        reqs.append(_ExtendRequest(start, num_new, slots, mask))
        start += num_new
    return reqs


def _decode_metadata(fb: ForwardBatch, min_padded_fill: float) -> _DecodeMetadata:
    max_len = max(fb.seq_lens_cpu)
    num_kv = fb.token_to_kv_pool.get_key_buffer(0).shape[1]
    table = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_len].to(torch.int64)
    heads = torch.arange(num_kv, device=table.device)
    if sum(fb.seq_lens_cpu) < min_padded_fill * len(fb.seq_lens_cpu) * max_len:
        per_request = [
            ((table[i, None, :n] * num_kv + heads[:, None]).reshape(-1), n)
            for i, n in enumerate(fb.seq_lens_cpu)
        ]
        return _DecodeMetadata(head_rows=None, mask=None, max_len=max_len, per_request=per_request)
    cols = torch.arange(max_len, device=table.device)
    valid = cols[None, :] < fb.seq_lens[:, None]
    slots = torch.where(valid, table, 0)
    head_rows = (slots[:, None, :] * num_kv + heads[None, :, None]).reshape(-1)
    # Equal lengths need no mask (SDPA then takes its faster unmasked path).
    mask = None if min(fb.seq_lens_cpu) == max_len else valid[:, None, None, :]
    return _DecodeMetadata(head_rows=head_rows, mask=mask, max_len=max_len)
