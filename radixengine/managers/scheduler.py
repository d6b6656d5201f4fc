"""Scheduler: continuous batching over the radix cache.

One step: recv (`recv_requests` → `process_input_requests`: validate, build `Req`, queue; in
scheduler_intake.py) → `get_next_batch_to_run` (prefill first; else the running decode batch,
after `update_running_batch`, which may retract; in scheduler_admission.py) → `run_batch` (the
worker client: ScheduleBatch → ModelWorkerBatch → forward → sample; in worker_client.py) →
`process_batch_result` (append tokens, check stop conditions, cache or free KV) and one
`BatchTokenIDOut` for the step (scheduler_output_processor.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Protocol

import torch

from radixengine.managers.fair_policy import FairPolicy
from radixengine.managers.grammar_manager import GrammarManager
from radixengine.managers.hicache_factory import make_radix_cache
from radixengine.managers.overlap_utils import StepTimer, write_chrome_trace
from radixengine.managers.req import Tokenizer
from radixengine.managers.schedule_batch import Req, ScheduleBatch
from radixengine.managers.schedule_policy import SchedulePolicy, has_prefix_tree
from radixengine.managers.scheduler_admission import SchedulerAdmissionMixin
from radixengine.managers.scheduler_intake import SchedulerIntakeMixin
from radixengine.managers.scheduler_io import InProcessIO, SchedulerIO, SchedulerIOClosed
from radixengine.managers.scheduler_metrics import SchedulerMetricsMixin, SchedulerStats
from radixengine.managers.scheduler_output_processor import SchedulerOutputProcessorMixin
from radixengine.managers.worker_client import OverlapResult, TpModelWorkerClient, make_worker_client
from radixengine.mem_cache.accounting import TokenAccountingError, check_token_accounting
from radixengine.mem_cache.allocator import BaseTokenToKVPoolAllocator
from radixengine.mem_cache.chunk_cache import ChunkCache
from radixengine.mem_cache.memory_pool import ReqToTokenPool
from radixengine.model_executor.forward_batch_info import ModelWorkerBatch
from radixengine.server_args import ServerArgs

if TYPE_CHECKING:
    from radixengine.model_executor.tp_worker import GenerationBatchResult, WorkerInfo

logger = logging.getLogger(__name__)

__all__ = ["Scheduler", "SchedulerStats"]


class ModelWorker(Protocol):
    """What the scheduler uses of TpModelWorker."""

    def get_worker_info(self) -> WorkerInfo: ...

    def get_memory_pool(self) -> tuple[ReqToTokenPool, BaseTokenToKVPoolAllocator]: ...

    def forward_batch_generation(
        self, model_worker_batch: ModelWorkerBatch, delay_sample: bool = False
    ) -> GenerationBatchResult: ...


class Scheduler(
    SchedulerIntakeMixin, SchedulerAdmissionMixin, SchedulerOutputProcessorMixin, SchedulerMetricsMixin
):
    def __init__(
        self,
        server_args: ServerArgs,
        tp_worker: ModelWorker | None = None,
        tokenizer: Tokenizer | None = None,
        io: SchedulerIO | None = None,
    ) -> None:
        self.server_args = server_args
        if tp_worker is None:
            from radixengine.model_executor.tp_worker import TpModelWorker

            tp_worker = TpModelWorker(server_args)
        self.tp_worker = tp_worker
        self.tokenizer = tokenizer
        self.io: SchedulerIO = io if io is not None else InProcessIO()
        self.page_size = server_args.page_size
        self._init_config(server_args)
        self._init_worker_info()
        self._init_memory_and_cache()
        self.grammar_manager = GrammarManager(
            server_args.grammar_backend,
            not server_args.constrained_json_disable_any_whitespace,
            tokenizer,
            self.vocab_size,
            self.eos_token_ids,
            wait_for_compile=server_args.tp_size > 1,
        )
        self.policy = SchedulePolicy(
            server_args.schedule_policy,
            self.tree_cache,
            enable_priority_scheduling=self.enable_priority_scheduling,
            schedule_low_priority_values_first=self.schedule_low_priority_values_first,
            lpm_fallback_queue_len=server_args.lpm_fallback_queue_len,
            enable_in_batch_prefix_caching=self.enable_in_batch_prefix_caching,
            fair=FairPolicy(server_args.lpm_aging_tokens_per_pass, server_args.dlpm_quantum_tokens),
        )
        self.init_admission()
        self.init_metrics()
        self._init_loop_state(server_args)

    def _init_config(self, args: ServerArgs) -> None:
        self.enable_priority_scheduling = self.try_preemption = args.enable_priority_scheduling
        self.schedule_low_priority_values_first = args.schedule_low_priority_values_first
        self.priority_scheduling_preemption_threshold = args.priority_scheduling_preemption_threshold
        self.max_queued_requests = args.max_queued_requests
        self.retract_decode_steps = args.retract_decode_steps
        self.retraction_policy = args.retraction_policy
        self.soft_priority_preemption = args.soft_priority_preemption
        self.enable_mixed_chunk = args.enable_mixed_chunk
        self.stream_interval = args.stream_interval
        self.decode_log_interval = args.decode_log_interval
        self.chunked_prefill_size = args.effective_chunked_prefill_size
        self.max_prefill_tokens = args.max_prefill_tokens
        self.init_new_token_ratio = args.init_ratio
        self.min_new_token_ratio = args.min_ratio
        self.new_token_ratio_decay = args.ratio_decay
        self.new_token_ratio = self.init_new_token_ratio

    def _init_loop_state(self, args: ServerArgs) -> None:
        self.cur_batch: ScheduleBatch | None = None
        self.last_batch: ScheduleBatch | None = None
        self._pending_outputs: list[Req] = []
        self._deferred_requests: list[object] = []
        self._shutdown = False
        self.timer = StepTimer(trace=args.trace_file is not None)
        self.step_ct = 0  # event-loop steps run (the watchdog's progress counter)
        self._trace_written_at = time.perf_counter()
        # Launched batches whose results are not processed yet (at most two, under overlap).
        self.result_queue: deque[tuple[ScheduleBatch, OverlapResult]] = deque()
        # The one overlap switch: how a batch runs (inline, or launched on the forward stream).
        self.model_worker = make_worker_client(
            self.tp_worker,
            self.timer,
            self.device,
            overlap=not args.disable_overlap_schedule,
            cpu_forward_stream=args.cpu_forward_stream,
            num_rows=self.req_to_token_pool.size,
            trace=args.trace_file is not None,
        )
        self.enable_overlap = isinstance(self.model_worker, TpModelWorkerClient)
        if self.enable_overlap and hasattr(self.tree_cache, "pool_write_stream"):
            self.tree_cache.pool_write_stream = self.model_worker.forward_stream

    def _init_worker_info(self) -> None:
        info = self.tp_worker.get_worker_info()
        self.max_total_num_tokens: int = info.max_total_num_tokens
        self.max_running_requests: int = info.max_running_requests
        self.max_req_len: int = info.max_req_len
        self.max_req_input_len: int = info.max_req_input_len
        self.context_len: int = info.context_len
        self.vocab_size: int = info.vocab_size
        self.eos_token_ids = frozenset(info.eos_token_ids) | _tokenizer_eos(self.tokenizer)
        self.device = torch.device(info.device)
        if info.page_size != self.page_size:
            raise ValueError(
                f"--page-size {self.page_size} differs from the worker's pools ({info.page_size})"
            )

    def _init_memory_and_cache(self) -> None:
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self.tp_worker.get_memory_pool()
        pools = (self.req_to_token_pool, self.token_to_kv_pool_allocator, self.page_size)
        if self.server_args.disable_radix_cache:
            self.tree_cache = ChunkCache(*pools)
        else:
            self.tree_cache = make_radix_cache(self.server_args, *pools)
        self.enable_in_batch_prefix_caching = (
            not self.server_args.disable_in_batch_prefix_caching and has_prefix_tree(self.tree_cache)
        )

    def _new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch.init_new(
            reqs,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            tree_cache=self.tree_cache,
            device=self.device,
            page_size=self.page_size,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
        )

    # One step ---------------------------------------------------------------------------------

    def run_batch(self, batch: ScheduleBatch) -> GenerationBatchResult | OverlapResult:
        self.stats.num_forward_steps += 1
        return self.model_worker.run_batch(batch)

    def run_step(self) -> ScheduleBatch | None:
        """One step of the event loop after input: schedule, run, process, stream."""
        if self.enable_overlap:
            return self.run_step_overlap()
        with self.timer.phase("schedule"):
            batch = self.get_next_batch_to_run()
        self.cur_batch = batch
        if batch is not None:
            with self.timer.phase("launch"):
                result = self.run_batch(batch)
            with self.timer.phase("process"):
                self.process_batch_result(batch, result)
        else:
            self.self_check_during_idle()
        self.last_batch = batch
        self._end_step()
        return batch

    def run_step_overlap(self) -> ScheduleBatch | None:
        """Launch batch N, then process batch N-1 while the device computes N."""
        with self.timer.phase("schedule"):
            batch = self.get_next_batch_to_run()
        self.cur_batch = batch
        if batch is not None:
            with self.timer.phase("launch"):
                result = self.run_batch(batch)
                self.result_queue.append((batch.copy(), result))
        if self.last_batch is not None:
            with self.timer.phase("process"):
                self.process_batch_result(*self.result_queue.popleft())
        elif batch is None:
            self.self_check_during_idle()
        if batch is not None:
            # After the previous batch's tokens are processed: the masks depend on them.
            self.model_worker.launch_sample_if_needed(result)
        self.last_batch = batch
        self._end_step()
        return batch

    def _end_step(self) -> None:
        self.step_ct += 1
        self.stream_output()
        self._answer_deferred_requests()
        self.timer.end_step()
        if self.server_args.trace_file and time.perf_counter() - self._trace_written_at > 5.0:
            self.write_trace()

    def is_idle(self) -> bool:
        """Nothing queued, running, or in a batch whose requests go on."""
        if (
            self.waiting_queue
            or self.chunked_req is not None
            or self.result_queue
            or len(self.grammar_manager)
        ):
            return False
        return all(r.finished() for r in self._active_reqs())

    def self_check_during_idle(self) -> None:
        """The token-accounting invariant, when nothing holds KV but the tree."""
        if not self.running_batch.is_empty() or self.chunked_req is not None:
            return
        try:
            check_token_accounting(self.token_to_kv_pool_allocator, self.tree_cache, self.req_to_token_pool)
        except TokenAccountingError as e:
            if self.server_args.test_mode:
                raise
            logger.error("%s", e)
        self.new_token_ratio = self.init_new_token_ratio
        self._reset_decode_stats()

    # Loops -------------------------------------------------------------------------------------

    def event_loop_normal(self) -> None:
        """Run until the I/O closes or `shutdown()` is called."""
        self._event_loop(overlap=False)

    def event_loop_overlap(self) -> None:
        """The overlap loop: the device computes batch N while the CPU processes batch N-1 and
        schedules batch N+1 (see `run_step_overlap`). The step order is fixed when the
        scheduler is built (`enable_overlap`), so both entry points run the same loop."""
        self._event_loop(overlap=True)

    def _event_loop(self, overlap: bool) -> None:
        if overlap and self.server_args.disable_overlap_schedule:
            raise RuntimeError("event_loop_overlap with --disable-overlap-schedule")
        try:
            while not self._shutdown:
                try:
                    with self.timer.phase("recv"):
                        self.process_input_requests(self.recv_requests(block=self.is_idle()))
                except SchedulerIOClosed:
                    return
                self.run_step()
        finally:
            if self.server_args.trace_file:
                self.write_trace()

    def shutdown(self) -> None:
        self._shutdown = True

    def close(self) -> None:
        """Stop the forward stream's worker (overlap on a CPU) and the cache's storage threads."""
        self.model_worker.close()
        if hasattr(self.tree_cache, "close"):
            self.tree_cache.close()

    def write_trace(self, path: str | None = None) -> None:
        """Chrome trace of the scheduler's phases and the forward stream's busy intervals."""
        path = path or self.server_args.trace_file
        if path is None or self.timer.events is None:
            return
        events = list(self.timer.events)
        device = self.model_worker.device_intervals(events)
        write_chrome_trace(path, events, device, self.timer.start_time)
        self._trace_written_at = time.perf_counter()

    def run_until_idle(self, max_steps: int = 100_000) -> int:
        """Test helper: step the event loop (the same code path) until nothing is queued,
        running, in flight or pending. Returns the number of steps; raises if `max_steps` pass
        first."""
        for step in range(1, max_steps + 1):
            self.process_input_requests(self.recv_requests(block=False))
            batch = self.run_step()
            if batch is None and self.is_idle() and not getattr(self.io, "inbox", None):
                return step
        raise RuntimeError(f"scheduler not idle after {max_steps} steps: {self.get_internal_state()}")


def _tokenizer_eos(tokenizer: Tokenizer | None) -> frozenset[int]:
    """The tokenizer's own EOS id (SGLang adds it to the model's EOS set)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset() if eos is None else frozenset({eos})
