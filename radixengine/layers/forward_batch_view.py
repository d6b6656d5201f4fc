"""What the layers and models read of a forward's batch; `model_executor`'s `ForwardBatch` provides
it. The layers name these Protocols, never `ForwardBatch`, so nothing under `layers/` or `models/`
imports the worker that runs them (as `mem_cache`'s `CacheReq` stands for the scheduler's `Req`)."""

from __future__ import annotations

from typing import Protocol

import torch

from radixengine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


class ForwardModeView(Protocol):
    """`ForwardMode`: EXTEND and MIXED are extends (prefills), DECODE is one new token per request;
    a prefill and a speculative verify share the extend layout."""

    def is_extend(self) -> bool: ...

    def has_extend_layout(self) -> bool: ...

    def is_decode(self) -> bool: ...


class AttentionLayer(Protocol):
    """What an attention backend reads of a `RadixAttention` layer."""

    layer_id: int
    tp_q_head_num: int
    tp_k_head_num: int
    tp_v_head_num: int
    qk_head_dim: int
    v_head_dim: int
    scaling: float
    logit_cap: float
    sliding_window_size: int


class AttentionRunner(Protocol):
    """The batch's attention backend, as `RadixAttention` calls it."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatchView,
        save_kv_cache: bool = True,
    ) -> torch.Tensor: ...


class ForwardBatchView(Protocol):
    """One forward's batch: device tensors, a few CPU lists, the pools and the attention backend.
    The `extend_*` fields are None except for an extend."""

    forward_mode: ForwardModeView
    batch_size: int
    input_ids: torch.Tensor  # int64 [num_tokens]
    req_pool_indices: torch.Tensor  # int64 [bs]
    seq_lens: torch.Tensor  # int64 [bs]: tokens with KV after this forward
    seq_lens_cpu: list[int]
    out_cache_loc: torch.Tensor  # int64 [num_tokens]
    extend_seq_lens: torch.Tensor | None
    extend_start_loc: torch.Tensor | None
    extend_seq_lens_cpu: list[int] | None
    extend_prefix_lens_cpu: list[int] | None
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    attn_backend: AttentionRunner
    top_logprobs_nums: list[int] | None
    input_logprob_indices: torch.Tensor | None
    input_logprob_token_ids: torch.Tensor | None

    def last_token_indices(self) -> torch.Tensor: ...
