"""Attention on a CPU in native code: K/V read in place through `req_to_token`, no gather.

The kernels live in `radixengine/csrc` (see `native_cpu_ops`); `torch_native` is the reference
they are tested against. Asking for this backend where the extension is not built raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.attention.base_attn_backend import (
    AttentionBackend,
    cascade_decode,
    decode_cascade_plan,
    paged_decode,
    paged_kernel_args,
    shared_prefix_min_len,
)
from radixengine.layers.attention.cascade_plan import CascadePlan

if TYPE_CHECKING:
    from radixengine.layers.forward_batch_view import ForwardBatchView


class NativeCpuAttnBackend(AttentionBackend):
    def __init__(self, model_runner=None) -> None:
        native_cpu_ops.require_native()
        self.shared_prefix_min_len = shared_prefix_min_len(model_runner)
        self.cascade_plan: CascadePlan | None = None
        self.num_shared_prefix_forwards = 0  # forwards that ran the shared-prefix pass
        if model_runner is not None:
            if model_runner.device.type != "cpu":
                raise ValueError("the native_cpu attention backend runs on a CPU only")
            head_dim = model_runner.model_config.head_dim
            kv_dtype = getattr(model_runner, "kv_cache_dtype", model_runner.dtype)
            if not native_cpu_ops.native_supports(model_runner.dtype, head_dim, kv_dtype):
                raise ValueError(
                    f"the native_cpu attention backend does not support dtype {model_runner.dtype} "
                    f"(KV cache {kv_dtype}) with head_dim {head_dim}"
                )

    def init_forward_metadata(self, forward_batch: ForwardBatchView) -> None:
        self.cascade_plan = decode_cascade_plan(forward_batch, self.shared_prefix_min_len)
        self.num_shared_prefix_forwards += self.cascade_plan is not None

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True) -> torch.Tensor:
        args = paged_kernel_args((q, k, v), layer, forward_batch, save_kv_cache)
        out = native_cpu_ops.extend_attention(
            *args,
            forward_batch.extend_seq_lens,
            forward_batch.extend_start_loc,
            layer.scaling,
            layer.sliding_window_size,
            layer.logit_cap,
        )
        return out.reshape(args[0].shape[0], -1)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True) -> torch.Tensor:
        plan = self.cascade_plan
        if plan is not None and layer.sliding_window_size < 0:
            kernel = native_cpu_ops.decode_attention_cascade
            return cascade_decode(kernel, (q, k, v), layer, forward_batch, save_kv_cache, plan)
        return paged_decode(native_cpu_ops.decode_attention, (q, k, v), layer, forward_batch, save_kv_cache)
