"""ForwardMode, ModelWorkerBatch (what the scheduler hands the model worker) and ForwardBatch (what
one forward pass of the model needs)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, auto
from typing import TYPE_CHECKING, Any, Protocol

import torch

from radixengine.speculative.spec_overlap import FutureVerify
from radixengine.speculative.spec_tree import DraftTrees
from radixengine.utils.host_to_device import to_device

if TYPE_CHECKING:
    from radixengine.layers.attention.base_attn_backend import AttentionBackend
    from radixengine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from radixengine.sampling.sampling_batch_info import SamplingBatchInfo


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill, possibly over a cached prefix
    DECODE = auto()  # one new token per request
    MIXED = auto()  # a prefill batch with the running requests' decode step (one token each) appended
    IDLE = auto()  # nothing to run
    # Speculative decoding: an extend of each request's last token and its draft tokens, with the
    # logits of every one of them (verified against the drafts instead of sampled once).
    TARGET_VERIFY = auto()

    def is_extend(self) -> bool:
        """EXTEND or MIXED (a prefill): a decode request in a MIXED batch is an extend of one token."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def has_extend_layout(self) -> bool:
        """The forward runs as a ragged extend over cached prefixes: a prefill or a verify."""
        return self.is_extend() or self.is_target_verify()

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE


class ForwardResources(Protocol):
    """What a forward takes of the model runner that runs it (`ModelRunner` provides it)."""

    device: torch.device
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    attn_backend: AttentionBackend


@dataclass
class ModelWorkerBatch:
    """What the scheduler hands the model worker: tensors on the model's device, and the few CPU
    lists the forward needs. Under the overlap loop `input_ids` may hold negative placeholders
    `-i` into the FutureMap, resolved on the forward stream before the forward."""

    forward_mode: ForwardMode
    input_ids: torch.Tensor  # int64 [num_tokens]
    req_pool_indices: torch.Tensor  # int64 [bs]: rows of ReqToTokenPool
    seq_lens: torch.Tensor  # int64 [bs]: tokens with KV after this forward
    seq_lens_cpu: list[int]
    out_cache_loc: torch.Tensor  # int64 [num_tokens]: KV slots the new tokens are written to
    extend_prefix_lens: list[int] | None  # EXTEND only: cached tokens per request
    extend_seq_lens: list[int] | None  # EXTEND only: new tokens per request
    sampling_info: SamplingBatchInfo
    return_logprob: bool = False
    # Per request, how many most likely tokens to report (None when no request asks for any).
    top_logprobs_nums: list[int] | None = None
    # EXTEND, when a request asks for prompt logprobs: the rows of input_ids whose logits give
    # them (request by request) and the prompt token each row predicts; None otherwise.
    input_logprob_indices: torch.Tensor | None = None
    input_logprob_token_ids: torch.Tensor | None = None
    # TARGET_VERIFY: each request's draft tree (node 0 its last token), padded to one width.
    spec_trees: DraftTrees | None = None
    # TARGET_VERIFY under the overlap loop: what the forward stream resolves before the forward
    # (speculative/spec_overlap.py); spec_trees, the lengths and out_cache_loc are then set.
    future_verify: FutureVerify | None = None
    # Per request, its LoRA adapter's id (None: the base model); None when no request has one.
    lora_ids: list[str | None] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class ForwardBatch:
    """Device tensors (and a few CPU lists) of one forward; built by `init_new`."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # int64 [num_tokens]
    req_pool_indices: torch.Tensor  # int64 [bs]
    seq_lens: torch.Tensor  # int64 [bs]: tokens with KV after this forward
    seq_lens_cpu: list[int]
    seq_lens_sum: int
    out_cache_loc: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]

    # EXTEND only: new tokens per request, cached prefix per request, offset of each request's
    # first new token in input_ids, and the index of each request's last token.
    extend_num_tokens: int | None = None
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens: torch.Tensor | None = None
    extend_start_loc: torch.Tensor | None = None
    extend_last_loc: torch.Tensor | None = None
    extend_seq_lens_cpu: list[int] | None = None
    extend_prefix_lens_cpu: list[int] | None = None

    req_to_token_pool: Any = None  # mem_cache.memory_pool.ReqToTokenPool
    token_to_kv_pool: Any = None  # mem_cache.memory_pool.MHATokenToKVPool
    attn_backend: AttentionBackend | None = None
    sampling_info: Any = None  # sampling.sampling_batch_info.SamplingBatchInfo
    return_logprob: bool = False
    top_logprobs_nums: list[int] | None = None
    input_logprob_indices: torch.Tensor | None = None  # int64 [rows]: see ModelWorkerBatch
    input_logprob_token_ids: torch.Tensor | None = None  # int64 [rows]
    lora_ids: list[str | None] | None = None  # see ModelWorkerBatch

    @classmethod
    def init_new(cls, batch: ModelWorkerBatch, model_runner: ForwardResources) -> ForwardBatch:
        device = model_runner.device
        seq_lens = batch.seq_lens.to(device)
        fb = cls(
            forward_mode=batch.forward_mode,
            batch_size=batch.batch_size,
            input_ids=batch.input_ids.to(device),
            req_pool_indices=batch.req_pool_indices.to(device),
            seq_lens=seq_lens,
            seq_lens_cpu=list(batch.seq_lens_cpu),
            seq_lens_sum=sum(batch.seq_lens_cpu),
            out_cache_loc=batch.out_cache_loc.to(device),
            positions=_decode_positions(seq_lens),
            req_to_token_pool=model_runner.req_to_token_pool,
            token_to_kv_pool=model_runner.token_to_kv_pool,
            attn_backend=model_runner.attn_backend,
            sampling_info=batch.sampling_info,
            return_logprob=batch.return_logprob,
            top_logprobs_nums=batch.top_logprobs_nums,
            lora_ids=batch.lora_ids,
        )
        if batch.input_logprob_indices is not None:
            fb.input_logprob_indices = batch.input_logprob_indices.to(device)
            fb.input_logprob_token_ids = batch.input_logprob_token_ids.to(device)
        if fb.forward_mode.has_extend_layout():
            fb._init_extend(batch.extend_prefix_lens, batch.extend_seq_lens, device)
        return fb

    def _init_extend(self, prefix_lens: list[int], extend_lens: list[int], device) -> None:
        prefix = torch.tensor(prefix_lens, dtype=torch.int64)
        extend = torch.tensor(extend_lens, dtype=torch.int64)
        start_loc = torch.cumsum(extend, 0) - extend
        num_tokens = int(extend.sum())
        offsets = torch.repeat_interleave(start_loc - prefix, extend, output_size=num_tokens)
        # Pinned, non-blocking copies: a prefill's setup does not wait for the forward in flight.
        self.positions = to_device(torch.arange(num_tokens) - offsets, device)
        self.extend_num_tokens = num_tokens
        self.extend_seq_lens = to_device(extend, device)
        self.extend_prefix_lens = to_device(prefix, device)
        self.extend_start_loc = to_device(start_loc, device)
        self.extend_last_loc = to_device(start_loc + extend - 1, device)
        self.extend_seq_lens_cpu = list(extend_lens)
        self.extend_prefix_lens_cpu = list(prefix_lens)

    def last_token_indices(self) -> torch.Tensor:
        """Rows of the hidden states whose logits are wanted: each request's last token (every
        token of a verify)."""
        if self.forward_mode.is_target_verify():
            return torch.arange(self.extend_num_tokens, device=self.input_ids.device)
        if self.forward_mode.is_extend():
            return self.extend_last_loc
        return torch.arange(self.batch_size, device=self.input_ids.device)


def _decode_positions(seq_lens: torch.Tensor) -> torch.Tensor:
    return (seq_lens - 1).clamp_(min=0)
