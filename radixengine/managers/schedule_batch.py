"""Req, ScheduleBatch and ModelWorkerBatch: a request's state and the batches built from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixengine.model_executor.forward_batch_info import ForwardMode
from radixengine.sampling.sampling_batch_info import SamplingBatchInfo


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

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)
