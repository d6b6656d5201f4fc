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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from radixengine.layers.forward_logprobs import ForwardLogprobs, tensor_to_host
from radixengine.layers.sampler import TopLogprobs
from radixengine.managers.overlap_utils import FutureMap, StepTimer
from radixengine.managers.schedule_batch import ScheduleBatch
from radixengine.mem_cache.allocator import BaseTokenToKVPoolAllocator
from radixengine.mem_cache.memory_pool import ReqToTokenPool
from radixengine.model_executor.forward_batch_info import ModelWorkerBatch
from radixengine.speculative.spec_overlap import resolve_future_verify
from radixengine.speculative.spec_verify import VerifyResult
from radixengine.utils.fault_injection import fault_point
from radixengine.utils.streams import (
    CpuStream,
    CudaStream,
    Event,
    HostStream,
    Stream,
    StreamError,
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

    def quiesce(self) -> None:
        """After a failed step: wait for what was launched, and accept new work again."""
        ...

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
            fault_point("grammar")
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
        with self.timer.phase("verify" if batch.forward_mode.is_target_verify() else "forward"):
            result = self.worker.forward_batch_generation(mwb)
        batch.output_ids = result.next_token_ids
        return result

    def launch_sample_if_needed(self, result: GenerationBatchResult) -> None:
        pass

    def quiesce(self) -> None:
        pass  # the forward ran on this thread: nothing is in flight

    def device_intervals(self, scheduler_events: list[tuple[str, float, float]]) -> list:
        return [(s, e, name) for name, s, e in scheduler_events if name in ("forward", "verify")]

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
    # A verify step: its result on the host, and the nodes each request verified (resolved on
    # the forward stream: a request whose drafts no longer held verified its root alone).
    verify: VerifyResult | None = None
    spec_num_nodes: list[int] | None = None


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
        spec_width: int = 0,
    ) -> None:
        super().__init__(worker, timer, device)
        self.forward_stream = forward_stream
        self.default_stream = get_default_stream(device)
        self.future_map = FutureMap(num_rows, device, spec_width)
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
            result,
            delay_sample,
            label="verify" if mwb.future_verify is not None else batch.forward_mode.name.lower(),
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
        self.forward_stream.submit(self._sample_on_stream, mwb, result, label="sample")
        result.copy_done = self.forward_stream.record_event()

    def device_intervals(self, scheduler_events: list[tuple[str, float, float]]) -> list:
        return list(self.forward_stream.busy)  # CpuStream or CudaStream (timed)

    def quiesce(self) -> None:
        """The launched work ends (a CPU stream skips what follows a failure); its error is
        dropped (a CUDA error raises again here: not recoverable in this process)."""
        try:
            self.forward_stream.synchronize()
        except StreamError:
            pass
        if isinstance(self.forward_stream, CpuStream):
            self.forward_stream.reset_error()
        self.batch_record_buf.clear()

    def close(self) -> None:
        if isinstance(self.forward_stream, CpuStream):
            self.forward_stream.close()

    def _forward_on_stream(
        self,
        mwb: ModelWorkerBatch,
        result: OverlapResult,
        delay_sample: bool = False,
    ) -> None:
        if mwb.future_verify is not None:
            self._resolve_verify(mwb)
        else:
            mwb.input_ids = self.future_map.resolve_future(mwb.input_ids)
        if delay_sample:
            result.forward_out = self.worker.forward_batch_generation(mwb, delay_sample=True)
            return
        out = self.worker.forward_batch_generation(mwb)
        self._publish_on_stream(out, mwb, result)

    def _resolve_verify(self, mwb: ModelWorkerBatch) -> None:
        """A verify step launched before its predecessor's result: its root, lengths, node counts,
        slots and sampling steps from what the predecessor stored in the FutureMap."""
        r = resolve_future_verify(mwb.future_verify, mwb.req_pool_indices, self.future_map.spec)
        trees = r.trees
        mwb.spec_trees = trees
        mwb.input_ids = trees.tokens[trees.valid()]
        mwb.seq_lens = r.prefix_lens + trees.num_nodes
        mwb.seq_lens_cpu = mwb.seq_lens.tolist()
        mwb.extend_prefix_lens = r.prefix_lens.tolist()
        mwb.extend_seq_lens = list(trees.num_nodes_cpu)
        mwb.out_cache_loc = r.out_cache_loc
        mwb.sampling_info.steps = r.steps

    def _sample_on_stream(self, mwb: ModelWorkerBatch, result: OverlapResult) -> None:
        out, result.forward_out = result.forward_out, None
        if out is None:
            raise RuntimeError("the forward of a batch with a delayed sample did not run")
        self._publish_on_stream(out.delay_sample_func(), mwb, result)

    def _publish_on_stream(
        self, out: GenerationBatchResult, mwb: ModelWorkerBatch, result: OverlapResult
    ) -> None:
        rows = mwb.req_pool_indices
        if out.verify is not None:
            trees = mwb.spec_trees
            self.future_map.store_verify(rows, out.verify, mwb.seq_lens - trees.num_nodes)
            result.verify = _verify_to_host(out.verify)
            result.spec_num_nodes = list(trees.num_nodes_cpu)
        else:
            self.future_map.store_to_map(rows, out.next_token_ids, mwb.seq_lens)
        result.next_token_ids = tensor_to_host(out.next_token_ids)
        if out.invalid_rows is not None:
            result.invalid_rows = tensor_to_host(out.invalid_rows)
        if out.logprobs is not None:
            result.logprobs = out.logprobs.to_host()


def _verify_to_host(v: VerifyResult) -> VerifyResult:
    def host(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else tensor_to_host(t)

    top = v.top_logprobs
    return VerifyResult(
        host(v.accept_lens),
        host(v.output_ids),
        host(v.path_nodes),
        host(v.logprobs),
        None if top is None else TopLogprobs(host(top.val), host(top.idx)),
        host(v.invalid_rows),
    )


def make_worker_client(
    worker: ModelWorker,
    timer: StepTimer,
    device: torch.device,
    overlap: bool,
    cpu_forward_stream: str,
    num_rows: int,
    trace: bool,
    spec_width: int = 0,
    on_forward_stream: Callable[[Stream], None] | None = None,
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
    if on_forward_stream is not None:  # e.g. the cache's pool writes, ordered after the forward
        on_forward_stream(stream)
    return TpModelWorkerClient(worker, timer, device, stream, num_rows, spec_width)
