"""Triton attention backend for CUDA: decode with a split-KV Triton kernel over `req_to_token`
(CUDA-graph safe: no host-side shapes depend on the batch's lengths); EXTEND as torch_native
(SDPA per request, flash kernels on CUDA). Both apply sliding windows and soft-capping.
"""

from __future__ import annotations

import functools

import torch

from radixengine.layers.attention.base_attn_backend import paged_decode
from radixengine.layers.attention.torch_native_backend import TorchNativeAttnBackend


class TritonAttnBackend(TorchNativeAttnBackend):
    supports_cuda_graph = True
    # Splits of each request's KV in decode; fixed so the grid depends on the batch size alone.
    num_kv_splits = 16

    def __init__(self, model_runner=None) -> None:
        super().__init__(model_runner)
        from radixengine.layers.triton_ops.decode_attention import decode_attention

        self._decode_attention = functools.partial(decode_attention, num_splits=self.num_kv_splits)

    def init_forward_metadata(self, forward_batch) -> None:
        if forward_batch.forward_mode.is_decode():
            return  # the kernel reads req_pool_indices and seq_lens on the device
        super().init_forward_metadata(forward_batch)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True) -> torch.Tensor:
        return paged_decode(self._decode_attention, (q, k, v), layer, forward_batch, save_kv_cache)
