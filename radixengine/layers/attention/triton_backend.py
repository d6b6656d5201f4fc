"""Triton attention backend for CUDA: decode with a split-KV Triton kernel over `req_to_token`
(CUDA-graph safe: no host-side shapes depend on the batch's lengths); EXTEND as torch_native
(SDPA per request, flash kernels on CUDA). Both apply sliding windows and soft-capping.
"""

from __future__ import annotations

import torch

from radixengine.layers.attention.base_attn_backend import save_kv
from radixengine.layers.attention.torch_native_backend import TorchNativeAttnBackend, _heads


class TritonAttnBackend(TorchNativeAttnBackend):
    supports_cuda_graph = True
    # Splits of each request's KV in decode; fixed so the grid depends on the batch size alone.
    num_kv_splits = 16

    def __init__(self, model_runner=None) -> None:
        super().__init__(model_runner)
        from radixengine.layers.triton_ops.decode_attention import decode_attention

        self._decode_attention = decode_attention

    def init_forward_metadata(self, forward_batch) -> None:
        if forward_batch.forward_mode.is_decode():
            return  # the kernel reads req_pool_indices and seq_lens on the device
        super().init_forward_metadata(forward_batch)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True) -> torch.Tensor:
        q, k, v = _heads(q, k, v, layer)
        if save_kv_cache:
            save_kv(k, v, layer, forward_batch)
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        out = self._decode_attention(
            q,
            k_buf,
            v_buf,
            forward_batch.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            layer.scaling,
            num_splits=self.num_kv_splits,
            window_left=layer.sliding_window_size,
            logit_cap=layer.logit_cap,
        )
        return out.view(q.shape[0], -1)
