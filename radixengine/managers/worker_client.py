"""How the scheduler runs a batch on the model worker, chosen once at construction.

`InlineWorkerClient`: fill the grammar masks, forward and sample, return the result.
`TpModelWorkerClient` (SGLang's name for its overlap wrapper): launch the forward on the forward
stream and return at once. The next batch reads this one's tokens as FutureMap placeholders,
resolved on the stream; with a grammar, the sample waits (`launch_sample_if_needed`) until the
masks can be filled from the tokens of the batch processed meanwhile.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from radixengine.layers.forward_logprobs import ForwardLogprobs, tensor_to_host
from radixengine.managers.overlap_utils import FutureMap, StepTimer
from radixengine.managers.schedule_batch import ScheduleBatch
from radixengine.mem_cache.allocator import BaseTokenToKVPoolAllocator
from radixengine.mem_cache.memory_pool import ReqToTokenPool
from radixengine.model_executor.forward_batch_info import ModelWorkerBatch
from radixengine.utils.streams import (
    CpuStream,
    CudaStream,
    Event,
    HostStream,
    Stream,
    get_default_stream,
    new_stream,
)

if TYPE_CHECKING:
    from radixengine.model_executor.tp_worker import GenerationBatchResult, WorkerInfo

logger = logging.getLogger(__name__)


class ModelWorker(Protocol):
    """What the scheduler and its clients use of TpModelWorker."""

    def get_worker_info(self) -> WorkerInfo: ...

    def get_memory_pool(self) -> tuple[ReqToTokenPool, BaseTokenToKVPoolAllocator]: ...

    def forward_batch_generation(
        self, model_worker_batch: ModelWorkerBatch, delay_sample: bool = False
    ) -> GenerationBatchResult: ...

    def num_shared_prefix_forwards(self) -> int: ...


class WorkerClient(Protocol):
    forward_stream: Stream | None  # None when the forward runs inline on the scheduler thread

    def run_batch(self, batch: ScheduleBatch) -> GenerationBatchResult | OverlapResult:
        """Run (or launch) the batch; its `output_ids` become the sampled tokens (or placeholders)."""
        ...

    def launch_sample_if_needed(self, result: GenerationBatchResult | OverlapResult) -> None: ...

    def device_intervals(self, scheduler_events: list[tuple[str, float, float]]) -> list: ...

    def close(self) -> None: ...


class _WorkerClientBase:
    def __init__(self, worker: ModelWorker, timer: StepTimer, device: torch.device) -> None:
        self.worker = worker
        self.timer = timer
        self.pin_memory = device.type == "cuda"

    def update_vocab_mask(self, batch: ScheduleBatch, mwb: ModelWorkerBatch) -> None:
        """This step's allowed-token masks of the batch's constrained rows, filled on the host
        from each matcher's state (SGLang's update_regex_vocab_mask)."""
        with self.timer.phase("grammar"):
            grammars = [r.samples_grammar() for r in batch.reqs]
            mwb.sampling_info.update_regex_vocab_mask(grammars, batch.vocab_size, pin_memory=self.pin_memory)


class InlineWorkerClient(_WorkerClientBase):
    """The normal step order: the forward runs on the scheduler thread."""

    def __init__(
        self,
        worker: ModelWorker,
        timer: StepTimer,
        device: torch.device,
        forward_stream: HostStream | None = None,
    ) -> None:
        super().__init__(worker, timer, device)
        self.forward_stream = forward_stream

    def run_batch(self, batch: ScheduleBatch) -> GenerationBatchResult:
        mwb = batch.get_model_worker_batch()
        if batch.has_grammar:
            self.update_vocab_mask(batch, mwb)
        with self.timer.phase("forward"):
            result = self.worker.forward_batch_generation(mwb)
        batch.output_ids = result.next_token_ids
        return result

    def launch_sample_if_needed(self, result: GenerationBatchResult) -> None:
        pass

    def device_intervals(self, scheduler_events: list[tuple[str, float, float]]) -> list:
        return [(s, e, "forward") for name, s, e in scheduler_events if name == "forward"]

    def close(self) -> None:
        pass


@dataclass
class OverlapResult:
    """A launched batch's result: filled on the forward stream; read after `copy_done`."""

    next_token_ids: torch.Tensor | None = None
    invalid_rows: torch.Tensor | None = None
    logprobs: ForwardLogprobs[torch.Tensor] | None = None
    copy_done: Event | None = None
    # A batch with a grammar, until its sample is launched: (the batch, its ModelWorkerBatch),
    # and the forward's result, whose delay_sample_func samples it.
    delayed_sample: tuple[ScheduleBatch, ModelWorkerBatch] | None = None
    forward_out: GenerationBatchResult | None = None


class TpModelWorkerClient(_WorkerClientBase):
    """The overlap step order: the forward runs on the forward stream (a CUDA stream, or a CPU
    worker thread) while the scheduler processes the previous batch."""

    def __init__(
        self,
        worker: ModelWorker,
        timer: StepTimer,
        device: torch.device,
        forward_stream: CpuStream | CudaStream,
        num_rows: int,
    ) -> None:
        super().__init__(worker, timer, device)
        self.forward_stream = forward_stream
        self.default_stream = get_default_stream(device)
        self.future_map = FutureMap(num_rows, device)
        # Keeps the inputs of the last two launched batches alive while the device reads them.
        self.batch_record_buf: deque[ModelWorkerBatch] = deque(maxlen=2)
        if isinstance(forward_stream, CpuStream):
            weakref.finalize(self, forward_stream.close)

    def run_batch(self, batch: ScheduleBatch) -> OverlapResult:
        mwb = batch.get_model_worker_batch()
        result = OverlapResult()
        self.batch_record_buf.append(mwb)
        self.forward_stream.wait_stream(self.default_stream)
        delay_sample = batch.has_grammar
        self.forward_stream.submit(
            self._forward_on_stream,
            mwb,
            batch.req_pool_indices,
            result,
            delay_sample,
            label=batch.forward_mode.name.lower(),
        )
        if delay_sample:
            result.delayed_sample = (batch, mwb)
        else:
            result.copy_done = self.forward_stream.record_event()
        batch.output_ids = self.future_map.placeholders(batch.req_pool_indices)
        return result

    def launch_sample_if_needed(self, result: OverlapResult) -> None:
        """A batch with a grammar: fill its masks now that the previous batch's tokens are
        accepted (while its forward still runs), then sample it on the forward stream."""
        pending = result.delayed_sample
        if pending is None:
            return
        result.delayed_sample = None
        batch, mwb = pending
        self.update_vocab_mask(batch, mwb)
        self.forward_stream.submit(self._sample_on_stream, batch.req_pool_indices, result, label="sample")
        result.copy_done = self.forward_stream.record_event()

    def device_intervals(self, scheduler_events: list[tuple[str, float, float]]) -> list:
        return list(self.forward_stream.busy)  # CpuStream or CudaStream (timed)

    def close(self) -> None:
        if isinstance(self.forward_stream, CpuStream):
            self.forward_stream.close()

    def _forward_on_stream(
        self,
        mwb: ModelWorkerBatch,
        req_pool_indices: torch.Tensor,
        result: OverlapResult,
        delay_sample: bool = False,
    ) -> None:
        mwb.input_ids = self.future_map.resolve_future(mwb.input_ids)
        if delay_sample:
            result.forward_out = self.worker.forward_batch_generation(mwb, delay_sample=True)
            return
        out = self.worker.forward_batch_generation(mwb)
        self._publish_on_stream(out, req_pool_indices, result)

    def _sample_on_stream(self, req_pool_indices: torch.Tensor, result: OverlapResult) -> None:
        out, result.forward_out = result.forward_out, None
        if out is None:
            raise RuntimeError("the forward of a batch with a delayed sample did not run")
        self._publish_on_stream(out.delay_sample_func(), req_pool_indices, result)

    def _publish_on_stream(
        self, out: GenerationBatchResult, req_pool_indices: torch.Tensor, result: OverlapResult
    ) -> None:
        self.future_map.store_to_map(req_pool_indices, out.next_token_ids)
        result.next_token_ids = tensor_to_host(out.next_token_ids)
        if out.invalid_rows is not None:
            result.invalid_rows = tensor_to_host(out.invalid_rows)
        if out.logprobs is not None:
            result.logprobs = out.logprobs.to_host()


def make_worker_client(
    worker: ModelWorker,
    timer: StepTimer,
    device: torch.device,
    overlap: bool,
    cpu_forward_stream: str,
    num_rows: int,
    trace: bool,
) -> InlineWorkerClient | TpModelWorkerClient:
    """The one overlap switch: the overlapped client, unless overlap is off or the forward stream
    runs inline (a CPU forward whose threads use every core: nothing could run alongside it, so
    launching N before processing N-1 would only cost a stale step)."""
    if not overlap:
        return InlineWorkerClient(worker, timer, device)
    stream = new_stream(device, "forward", cpu_layout=cpu_forward_stream)
    if isinstance(stream, HostStream):
        logger.info(
            "overlap schedule: --cpu-forward-stream %s runs the CPU forward inline; running the normal step order",
            cpu_forward_stream,
        )
        return InlineWorkerClient(worker, timer, device, forward_stream=stream)
    if isinstance(stream, CpuStream):
        logger.info(
            "overlap schedule: --cpu-forward-stream %s runs the CPU forward on a worker thread",
            cpu_forward_stream,
        )
    elif trace and isinstance(stream, CudaStream):
        stream.enable_timing()
    return TpModelWorkerClient(worker, timer, device, stream, num_rows)
