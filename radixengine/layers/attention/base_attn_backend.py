"""The attention backend interface.

A backend is made once per ModelRunner. Each forward calls `init_forward_metadata(forward_batch)`
once, then `forward(q, k, v, layer, forward_batch)` once per layer. `forward` writes the new
tokens' K/V into the KV pool at `forward_batch.out_cache_loc` (unless `save_kv_cache` is False)
and returns the attention output `[num_tokens, num_heads * head_dim]`.

EXTEND: the new tokens of each request attend, causally, to that request's cached prefix (read
through `req_to_token`) and to themselves. DECODE: one token per request attends to the
request's whole KV (`seq_lens` includes the new token).

`layer` is a RadixAttention: `layer_id`, `tp_q_head_num`, `tp_k_head_num`, `tp_v_head_num`,
`qk_head_dim`, `v_head_dim`, `scaling`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixengine.layers import native_small_ops  # a module: it imports this package too
from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.attention.cascade_plan import CascadePlan, build_cascade_plan
from radixengine.layers.triton_ops import use_fused_ops

if TYPE_CHECKING:
    from radixengine.layers.forward_batch_view import AttentionLayer, ForwardBatchView


class AttentionBackend(ABC):
    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatchView) -> None:
        """Compute what every layer of this forward shares (indices, masks, plans)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatchView,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatchView,
        save_kv_cache: bool = True,
    ) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatchView,
        save_kv_cache: bool = True,
    ) -> torch.Tensor: ...


def split_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as `[num_tokens, heads, head_dim]`."""
    return (
        q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
        k.view(-1, layer.tp_k_head_num, layer.qk_head_dim),
        v.view(-1, layer.tp_v_head_num, layer.v_head_dim),
    )


QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def paged_kernel_args(
    qkv: QKV, layer: AttentionLayer, forward_batch: ForwardBatchView, save_kv_cache: bool
) -> tuple[torch.Tensor, ...]:
    """The leading arguments of a kernel that reads the KV pool in place through `req_to_token`
    (native CPU, Triton): q `[num_tokens, heads, head_dim]`, the layer's K and V buffers,
    `req_to_token`, `req_pool_indices`, `seq_lens`. The new tokens' K/V are written first."""
    q, k, v = split_heads(*qkv, layer)
    if save_kv_cache:
        save_kv(k, v, layer, forward_batch)
    k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    fb = forward_batch
    return q, k_buf, v_buf, fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens


def paged_decode(
    kernel: Callable[..., torch.Tensor],
    qkv: QKV,
    layer: AttentionLayer,
    forward_batch: ForwardBatchView,
    save: bool,
) -> torch.Tensor:
    """DECODE through a paged decode kernel (`native_cpu_ops.decode_attention`, the Triton
    `decode_attention`) called as `kernel(q, k_buffer, v_buffer, req_to_token, req_pool_indices,
    seq_lens, scale, window_left=..., logit_cap=...)`: the one body of both backends' DECODE."""
    args = paged_kernel_args(qkv, layer, forward_batch, save)
    out = kernel(*args, layer.scaling, window_left=layer.sliding_window_size, logit_cap=layer.logit_cap)
    return out.reshape(args[0].shape[0], -1)


def save_kv(k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatchView) -> None:
    """Write the new tokens' K/V `[num_tokens, kv_heads, head_dim]` at `out_cache_loc`."""
    pool, loc = forward_batch.token_to_kv_pool, forward_batch.out_cache_loc
    k_buffer, v_buffer = pool.get_kv_buffer(layer.layer_id)
    if _writes_native(k, v, k_buffer, loc):
        native_cpu_ops.set_kv_buffer(k_buffer, v_buffer, loc, k, v)
    elif _writes_triton(k, v, k_buffer, v_buffer):
        from radixengine.layers.triton_ops.rope_kv import store_kv

        store_kv(k, v, k_buffer, v_buffer, loc)
    else:
        pool.set_kv_buffer(layer.layer_id, loc, k, v)


@dataclass
class FusedSetKVBufferArg:
    """The K/V write a Triton rotary launch does itself (SGLang's name): k, its last
    `value.shape[1]` heads once rotated, and `value` into the buffers at `cache_loc`."""

    value: torch.Tensor  # [num_tokens, kv_heads, head_dim]
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    cache_loc: torch.Tensor


def fused_set_kv_buffer_arg(
    k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatchView
) -> FusedSetKVBufferArg | None:
    """The write `save_kv` would do with the Triton kernel, for the rotary to do instead (then the
    attention is called with `save_kv_cache=False`); None where `save_kv` takes another path."""
    loc = forward_batch.out_cache_loc
    k_buffer, v_buffer = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    if _writes_native(k, v, k_buffer, loc) or not _writes_triton(k, v, k_buffer, v_buffer):
        return None
    return FusedSetKVBufferArg(v, k_buffer, v_buffer, loc)


def _writes_native(k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor, loc: torch.Tensor) -> bool:
    native_buffers = k_buffer.is_cpu and k_buffer.dtype in native_cpu_ops.NATIVE_KV_DTYPES
    return native_small_ops.runs_native(k, v) and native_buffers and loc.is_cpu and k.dim() == 3


def _writes_triton(k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> bool:
    return use_fused_ops(k) and rows_contiguous(k, v, k_buffer, v_buffer)


def rows_contiguous(*ts: torch.Tensor) -> bool:
    """Each `[tokens, heads, dim]` tensor's token row is one contiguous run."""
    return all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in ts)


def shared_prefix_min_len(model_runner) -> int | None:
    """The shortest prefix given its own shared-prefix pass, or None when the pass is off (the
    switch, a device other than the CPU, or no model runner: a backend built bare in a test)."""
    args = getattr(model_runner, "server_args", None)
    if args is None or args.disable_shared_prefix_attention or model_runner.device.type != "cpu":
        return None
    return args.shared_prefix_attention_min_len


def decode_cascade_plan(forward_batch: ForwardBatchView, min_len: int | None) -> CascadePlan | None:
    """The shared-prefix plan of a DECODE batch (None: off, not a decode, or nothing shared)."""
    if min_len is None or not forward_batch.forward_mode.is_decode():
        return None
    return build_cascade_plan(
        forward_batch.req_to_token_pool.req_to_token,
        forward_batch.req_pool_indices,
        forward_batch.seq_lens_cpu,
        min_len,
        num_threads=torch.get_num_threads(),
    )


def cascade_decode(
    kernel: Callable[..., torch.Tensor],
    qkv: QKV,
    layer: AttentionLayer,
    forward_batch: ForwardBatchView,
    save: bool,
    plan: CascadePlan,
) -> torch.Tensor:
    """DECODE with a shared-prefix plan through `kernel` (`native_cpu_ops.decode_attention_cascade`
    or its reference); the layer must have no sliding window."""
    args = paged_kernel_args(qkv, layer, forward_batch, save)
    out = kernel(*args, layer.scaling, *plan.kernel_args(), logit_cap=layer.logit_cap)
    return out.reshape(args[0].shape[0], -1)
