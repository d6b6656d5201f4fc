"""Triton attention backend for CUDA. DECODE: a split-KV Triton kernel over `req_to_token`
(CUDA-graph safe: no host-side shapes depend on the batch's lengths). EXTEND and MIXED: one
Triton kernel launch per layer for the whole batch over the paged pool (cached prefix and new
tokens, causal; `triton_ops/extend_attention.py`). Both apply sliding windows and soft-capping.
A speculative verify (tree masks) runs torch_native's per-request SDPA, the extend's reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from radixengine.layers.attention.base_attn_backend import paged_decode, save_kv, split_heads
from radixengine.layers.attention.torch_native_backend import TorchNativeAttnBackend
from radixengine.utils.host_to_device import host_tensor


@dataclass
class ExtendMetadata:
    """The extend kernel's per-request tensors (on the device) and the longest extend (host)."""

    prefix_lens: torch.Tensor  # int32 [bs]
    extend_lens: torch.Tensor  # int32 [bs]
    q_starts: torch.Tensor  # int32 [bs]: each request's first new token in the batch
    max_extend_len: int

    @classmethod
    def from_lists(cls, prefix_lens: list[int], extend_lens: list[int], device) -> ExtendMetadata:
        starts, total = [], 0
        for n in extend_lens:
            starts.append(total)
            total += n
        return cls(
            host_tensor(prefix_lens, torch.int32, device),
            host_tensor(extend_lens, torch.int32, device),
            host_tensor(starts, torch.int32, device),
            max(extend_lens, default=0),
        )


class TritonAttnBackend(TorchNativeAttnBackend):
    supports_cuda_graph = True
    # The most splits of each request's KV in decode; the count depends on the batch size alone
    # (`decode_num_splits`), so a graph captured for a batch size keeps it.
    num_kv_splits = 16

    def __init__(self, model_runner=None) -> None:
        super().__init__(model_runner)
        from radixengine.layers.triton_ops.decode_attention import decode_attention, decode_num_splits
        from radixengine.layers.triton_ops.extend_attention import extend_attention

        self._decode_attention = decode_attention
        self._decode_num_splits = decode_num_splits
        self._extend_attention = extend_attention
        device = getattr(model_runner, "device", None)
        cuda = device is not None and torch.device(device).type == "cuda"
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 132
        self.extend_metadata: ExtendMetadata | None = None

    def init_forward_metadata(self, forward_batch) -> None:
        self.extend_metadata = None
        if forward_batch.forward_mode.is_decode():
            return  # the kernel reads req_pool_indices and seq_lens on the device
        if forward_batch.forward_mode.is_extend():
            self._forward_batch = forward_batch
            self.extend_metadata = ExtendMetadata.from_lists(
                forward_batch.extend_prefix_lens_cpu,
                forward_batch.extend_seq_lens_cpu,
                forward_batch.input_ids.device,
            )
            return
        super().init_forward_metadata(forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True) -> torch.Tensor:
        if forward_batch is not self._forward_batch:  # a forward that skipped init_forward_metadata
            self.init_forward_metadata(forward_batch)
        meta = self.extend_metadata
        if meta is None:  # a verify: the per-request reference
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        q, k, v = split_heads(q, k, v, layer)
        if save_kv_cache:
            save_kv(k, v, layer, forward_batch)
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        out = self._extend_attention(
            q,
            k_buf,
            v_buf,
            forward_batch.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            meta.prefix_lens,
            meta.extend_lens,
            meta.q_starts,
            meta.max_extend_len,
            layer.scaling,
            window_left=layer.sliding_window_size,
            logit_cap=layer.logit_cap,
        )
        return out.reshape(q.shape[0], -1)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True) -> torch.Tensor:
        splits = self._decode_num_splits(
            forward_batch.batch_size, layer.tp_k_head_num, self.num_sms, self.num_kv_splits
        )
        kernel = functools.partial(self._decode_attention, num_splits=splits)
        return paged_decode(kernel, (q, k, v), layer, forward_batch, save_kv_cache)
