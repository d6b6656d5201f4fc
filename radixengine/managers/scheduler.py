"""Scheduler: continuous batching over the radix cache — the event loop and the wiring of its
components (managers/scheduler_components/).

One step: intake (`recv_requests` → `RequestIntake`: validate, build `Req`, queue) →
`get_next_batch_to_run` returns a `StepPlan` (a prefill batch from `PrefillAdmission`; else the
running decode batch after `RunningBatchUpdater`, which may retract) that `run_step` applies →
`run_batch` (the worker client: forward, sample) → `BatchResultProcessor` (append tokens, stop
conditions, cache or free KV) → `OutputStreamer` (one `BatchTokenIDOut` a step). A step that
raises ends its own requests (`StepRecovery`), not the process.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from radixengine.managers.fair_policy import FairPolicy
from radixengine.managers.grammar_manager import GrammarManager
from radixengine.managers.hicache_factory import make_tree_cache
from radixengine.managers.io_struct import FlushCacheReqInput, FlushCacheReqOutput, GetInternalStateReqOutput
from radixengine.managers.overlap_utils import StepTimer, write_chrome_trace
from radixengine.managers.req import Tokenizer
from radixengine.managers.schedule_batch import Req, ScheduleBatch
from radixengine.managers.schedule_policy import SchedulePolicy, has_prefix_tree
from radixengine.managers.scheduler_components.batch_result_processor import (
    BatchResultProcessor,
    ResultContext,
)
from radixengine.managers.scheduler_components.lora_adapters import make_lora_adapters
from radixengine.managers.scheduler_components.metrics_reporter import MemoryView, MetricsReporter, QueueView
from radixengine.managers.scheduler_components.new_token_ratio import NewTokenRatioTracker
from radixengine.managers.scheduler_components.output_streamer import OutputStreamer
from radixengine.managers.scheduler_components.overlap_spec_step import OverlapSpecStep
from radixengine.managers.scheduler_components.prefill_admission import (
    AdmissionConfig,
    AdmissionPeers,
    AdmissionPools,
    PrefillAdmission,
)
from radixengine.managers.scheduler_components.request_intake import QueueConfig, RequestIntake, RequestLimits
from radixengine.managers.scheduler_components.running_batch_updater import (
    RetractionConfig,
    RunningBatchUpdater,
)
from radixengine.managers.scheduler_components.scheduler_stats import SchedulerStats
from radixengine.managers.scheduler_components.speculative_drafter import make_drafter
from radixengine.managers.scheduler_components.step_plan import StepPlan
from radixengine.managers.scheduler_components.step_recovery import make_step_recovery
from radixengine.managers.scheduler_io import InProcessIO, SchedulerIO, SchedulerIOClosed
from radixengine.managers.served_model import tokenizer_eos_ids
from radixengine.managers.worker_client import (
    ModelWorker,
    OverlapResult,
    TpModelWorkerClient,
    make_worker_client,
)
from radixengine.mem_cache.accounting import TokenAccountingError, check_token_accounting
from radixengine.server_args import ServerArgs
from radixengine.speculative.spec_args import max_verify_nodes
from radixengine.utils.fault_injection import fault_point

if TYPE_CHECKING:
    from radixengine.model_executor.tp_worker import GenerationBatchResult

logger = logging.getLogger(__name__)

__all__ = ["Scheduler", "SchedulerStats"]


class Scheduler:
    def __init__(
        self,
        server_args: ServerArgs,
        tp_worker: ModelWorker | None = None,
        tokenizer: Tokenizer | None = None,
        io: SchedulerIO | None = None,
        eos_token_ids: frozenset[int] | None = None,
    ) -> None:
        """`eos_token_ids`: the stop ids (default: the worker's and the tokenizer's)."""
        self.server_args = server_args
        if tp_worker is None:
            from radixengine.model_executor.tp_worker import TpModelWorker

            tp_worker = TpModelWorker(server_args)
        self.tp_worker = tp_worker
        self.tokenizer = tokenizer
        self.io: SchedulerIO = io if io is not None else InProcessIO()
        self.page_size = server_args.page_size
        self._init_worker_info(eos_token_ids)
        self.req_to_token_pool, self.token_to_kv_pool_allocator = tp_worker.get_memory_pool()
        self.tree_cache = make_tree_cache(
            server_args, self.req_to_token_pool, self.token_to_kv_pool_allocator
        )
        self.timer = StepTimer(trace=server_args.trace_file is not None)
        self.model_worker = make_worker_client(  # the one overlap switch: how a batch runs
            self.tp_worker,
            self.timer,
            self.device,
            overlap=not server_args.disable_overlap_schedule,
            cpu_forward_stream=server_args.cpu_forward_stream,
            num_rows=self.req_to_token_pool.size,
            trace=server_args.trace_file is not None,
            spec_width=max_verify_nodes(server_args),
            on_forward_stream=self.tree_cache.set_pool_write_stream,  # cache loads after the forward
        )
        # Launched batches whose results are not processed yet (at most two, under overlap).
        self.result_queue: deque[tuple[ScheduleBatch, OverlapResult]] = deque()
        self.enable_overlap = isinstance(self.model_worker, TpModelWorkerClient)
        self._init_components(server_args)
        self._init_loop_state(server_args)

    def _init_worker_info(self, eos_token_ids: frozenset[int] | None) -> None:
        info = self.tp_worker.get_worker_info()
        self.max_total_num_tokens: int = info.max_total_num_tokens
        self.max_running_requests: int = info.max_running_requests
        self.max_req_len: int = info.max_req_len
        self.max_req_input_len: int = info.max_req_input_len
        self.context_len: int = info.context_len
        self.vocab_size: int = info.vocab_size
        if eos_token_ids is None:
            eos_token_ids = frozenset(info.eos_token_ids) | tokenizer_eos_ids(self.tokenizer)
        self.eos_token_ids = eos_token_ids
        self.device = torch.device(info.device)
        if info.page_size != self.page_size:
            raise ValueError(
                f"--page-size {self.page_size} differs from the worker's pools ({info.page_size})"
            )

    def _init_components(self, args: ServerArgs) -> None:
        self.stats = SchedulerStats()
        self.ratio = NewTokenRatioTracker(args.init_ratio, args.min_ratio, args.ratio_decay)
        self.streamer = OutputStreamer(
            self.io,
            args.stream_interval,
            args.speculative_algorithm is not None,
            args.enable_hierarchical_cache,
        )
        self.grammar_manager = GrammarManager.from_server_args(
            args, self.tokenizer, self.vocab_size, self.eos_token_ids
        )
        self.intake = self._new_intake(args)
        memory = MemoryView(self.token_to_kv_pool_allocator, self.tree_cache, self.max_total_num_tokens)
        graph_runner = getattr(getattr(self.tp_worker, "model_runner", None), "cuda_graph_runner", None)
        self.metrics = MetricsReporter(
            self.stats, memory, self.device, graph_runner, args.decode_log_interval
        )
        self.admission = self._new_admission(args)
        self.drafter = make_drafter(args)
        overlap_spec = None
        if self.enable_overlap and self.drafter is not None:  # verify steps launched ahead
            overlap_spec = OverlapSpecStep(self.drafter, self.result_queue, self.timer)
        retraction = RetractionConfig(
            args.retract_decode_steps, args.retraction_policy, args.schedule_low_priority_values_first
        )
        self.decode_updater = RunningBatchUpdater(
            retraction,
            self.ratio,
            self.stats,
            self.intake,
            self.streamer,
            self.admission.note_departures,
            self.drafter,
            self.timer,
            overlap_spec,
        )
        self.result_processor = self._new_result_processor()
        self.recovery = make_step_recovery(self)

    def _new_intake(self, args: ServerArgs) -> RequestIntake:
        return RequestIntake(
            RequestLimits(self.vocab_size, self.max_req_input_len, self.max_req_len),
            QueueConfig.of(args),
            self.grammar_manager,
            self.tokenizer,
            self.eos_token_ids,
            self.streamer,
            self._active_reqs,
            self.tree_cache,
            lora=make_lora_adapters(args, self.tp_worker, self.io.send),
        )

    def _new_result_processor(self) -> BatchResultProcessor:
        pools = (self.tree_cache, self.token_to_kv_pool_allocator, self.page_size)
        ctx = ResultContext(*pools, self.vocab_size, self.eos_token_ids, self.tokenizer)
        return BatchResultProcessor(
            ctx,
            self.timer,
            self.stats,
            self.streamer,
            lambda batch: self.metrics.log_decode_stats(batch, len(self.intake.waiting_queue)),
            self.drafter,
        )

    def _new_admission(self, args: ServerArgs) -> PrefillAdmission:
        in_batch_prefix_caching = not args.disable_in_batch_prefix_caching and has_prefix_tree(
            self.tree_cache
        )
        self.policy = SchedulePolicy(
            args.schedule_policy,
            self.tree_cache,
            enable_priority_scheduling=args.enable_priority_scheduling,
            schedule_low_priority_values_first=args.schedule_low_priority_values_first,
            lpm_fallback_queue_len=args.lpm_fallback_queue_len,
            enable_in_batch_prefix_caching=in_batch_prefix_caching,
            fair=FairPolicy(args.lpm_aging_tokens_per_pass, args.dlpm_quantum_tokens),
        )
        config = AdmissionConfig.from_server_args(
            args, self.max_running_requests, self.enable_overlap, in_batch_prefix_caching, self.eos_token_ids
        )
        pools = AdmissionPools(self.tree_cache, self.token_to_kv_pool_allocator, self.req_to_token_pool)
        peers = AdmissionPeers(
            self.intake,
            self.policy,
            self.ratio,
            self.stats,
            self.metrics,
            self.streamer,
            self._new_batch,
            self._inflight_prefill_reqs,
        )
        return PrefillAdmission(config, pools, peers)

    def _init_loop_state(self, args: ServerArgs) -> None:
        self.running_batch: ScheduleBatch = self._new_batch([])
        self.cur_batch: ScheduleBatch | None = None
        self.last_batch: ScheduleBatch | None = None
        self._shutdown = False
        self.step_ct = 0  # event-loop steps run (the watchdog's progress counter)
        self._trace_written_at = time.perf_counter()

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

    @property
    def waiting_queue(self) -> list[Req]:
        return self.intake.waiting_queue

    @property
    def chunked_req(self) -> Req | None:
        return self.admission.chunked_req

    @property
    def batch_is_full(self) -> bool:
        return self.admission.batch_is_full(self.running_batch)

    @property
    def new_token_ratio(self) -> float:
        return self.ratio.value

    def recv_requests(self, block: bool = False) -> list[object]:
        """The scheduler's one receive point."""
        return self.io.recv(block)

    def process_input_requests(self, msgs: list[object]) -> None:
        self.intake.process_input_requests(msgs)

    def get_next_batch_to_run(self) -> StepPlan:
        """This step's plan: a prefill batch if admission makes one, else the running batch's
        decode step. Batches change on the way (filtered, merged, retracted); the running batch
        the step leaves is in the plan, for `apply_step_plan`."""
        if len(self.grammar_manager):
            nothing_else = (
                self.running_batch.is_empty() and self.chunked_req is None and not self.result_queue
            )
            self.intake.move_ready_grammar_requests(nothing_else)
        self.admission.end_chunk_round(self.last_batch)
        running = self.running_batch
        if self.last_batch is not None and self.last_batch.forward_mode.is_extend():
            running = self.admission.merge_last_prefill(self.last_batch, running)
        plan = self.admission.get_new_batch_prefill(running)
        if plan.batch is not None or plan.running_batch.is_empty():
            return plan
        running = self.decode_updater.update_running_batch(plan.running_batch)
        return StepPlan(None if running.is_empty() else running, running)

    def apply_step_plan(self, plan: StepPlan) -> ScheduleBatch | None:
        """The one place the running batch changes; returns the batch to run."""
        self.running_batch = plan.running_batch
        self.cur_batch = plan.batch
        if plan.batch is not None:
            self.recovery.enter(plan.batch.reqs)
            fault_point("schedule")
        return plan.batch

    def run_batch(self, batch: ScheduleBatch) -> GenerationBatchResult | OverlapResult:
        self.stats.add_forward_step()
        fault_point("prepare")
        return self.model_worker.run_batch(batch)

    def process_batch_result(
        self, batch: ScheduleBatch, result: GenerationBatchResult | OverlapResult
    ) -> None:
        self.recovery.enter(batch.reqs)
        fault_point("process")
        self.result_processor.process_batch_result(batch, result)

    def run_step(self) -> ScheduleBatch | None:
        """One step after input, in the order the scheduler was built for."""
        return self.run_step_overlap() if self.enable_overlap else self.run_step_normal()

    def run_step_normal(self) -> ScheduleBatch | None:
        """Schedule, run, process, stream."""
        self.recovery.enter(None)
        with self.timer.phase("schedule"):
            batch = self.apply_step_plan(self.get_next_batch_to_run())
        if batch is not None:
            with self.timer.phase("launch"):
                result = self.run_batch(batch)
                self.model_worker.launch_sample_if_needed(result)
            with self.timer.phase("process"):
                self.process_batch_result(batch, result)
        else:
            self.self_check_during_idle()
        self.last_batch = batch
        self._end_step()
        return batch

    def run_step_overlap(self) -> ScheduleBatch | None:
        """Launch batch N, then process batch N-1 while the device computes N."""
        self.recovery.enter(None)
        with self.timer.phase("schedule"):
            batch = self.apply_step_plan(self.get_next_batch_to_run())
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
            self.recovery.enter(batch.reqs)
            self.model_worker.launch_sample_if_needed(result)
        self.last_batch = batch
        self._end_step()
        return batch

    def _end_step(self) -> None:
        self.step_ct += 1
        self.streamer.stream_output()
        self._answer_deferred_requests()
        self.timer.end_step()
        if self.server_args.trace_file and time.perf_counter() - self._trace_written_at > 5.0:
            self.write_trace()

    def _active_reqs(self) -> list[Req]:
        """Requests admitted and not yet released (with repeats)."""
        reqs = list(self.running_batch.reqs)
        for batch in (self.last_batch, self.cur_batch):
            if batch is not None:
                reqs.extend(batch.reqs)
        if self.chunked_req is not None:
            reqs.append(self.chunked_req)
        return reqs

    def _inflight_prefill_reqs(self) -> list[Req]:
        """Requests of launched prefill batches whose results are not processed yet (their
        prefixes are not in the tree yet). None in the normal loop."""
        return [
            r
            for batch, _ in self.result_queue
            if batch.forward_mode.is_extend()
            for i, r in enumerate(batch.reqs)
            if not batch.is_decoding_req(i)
        ]

    def is_idle(self) -> bool:
        """Nothing queued, running, or in a batch whose requests go on."""
        busy = self.waiting_queue or self.result_queue or len(self.grammar_manager)
        if busy or self.chunked_req is not None:
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
        self.ratio.reset()
        self.metrics.reset_decode_stats()

    def get_internal_state(self) -> dict:
        return self.metrics.internal_state(
            QueueView(self._active_reqs(), self.waiting_queue),
            len(self.grammar_manager),
            self.ratio.value,
            self.tp_worker.num_shared_prefix_forwards(),
        )

    def flush_cache(self) -> bool:
        return self._flush_cache()[0]

    def _flush_cache(self) -> tuple[bool, str]:
        if not self.is_idle():
            running = sum(1 for r in set(self._active_reqs()) if not r.finished())
            message = f"Cache not flushed: {running} running and {len(self.waiting_queue)} waiting requests."
            logger.warning(message)
            return False, message
        self.grammar_manager.reset()
        self.recovery.pools.reset()
        self._reset_loop_state()
        return True, "Cache flushed."

    def _reset_loop_state(self) -> None:  # nothing runs, nothing is launched
        self.apply_step_plan(StepPlan(None, self._new_batch([])))
        self.last_batch = None
        self.ratio.reset()

    def _answer_deferred_requests(self) -> None:
        for msg in self.intake.take_deferred():
            if isinstance(msg, FlushCacheReqInput):
                ok, message = self._flush_cache()
                self.io.send(FlushCacheReqOutput(success=ok, message=message))
            else:
                self.io.send(GetInternalStateReqOutput(state=self.get_internal_state()))

    def event_loop_normal(self) -> None:
        """Run normal steps until the I/O closes or `shutdown()` is called."""
        self._event_loop(self.run_step_normal)

    def event_loop_overlap(self) -> None:
        """The device computes batch N while the CPU processes N-1 and schedules N+1."""
        if not self.enable_overlap:  # --disable-overlap-schedule, or a CPU stream that runs inline
            raise RuntimeError("event_loop_overlap: this scheduler runs its forward inline")
        self._event_loop(self.run_step_overlap)

    def _event_loop(self, step) -> None:
        try:
            while not self._shutdown:
                try:
                    with self.timer.phase("recv"):
                        self.process_input_requests(self.recv_requests(block=self.is_idle()))
                except SchedulerIOClosed:
                    return
                try:
                    step()
                except Exception as e:  # one step's requests fail, not the process
                    self.contain_step_failure(e)
        finally:
            if self.server_args.trace_file:
                self.write_trace()

    def contain_step_failure(self, error: Exception) -> None:
        """`StepRecovery`; not under TP (the ranks would part ways: all exit and restart)."""
        if self.server_args.tp_size > 1:
            raise error
        self.recovery.contain(error, self.step_ct)
        self.admission.reset()
        self._reset_loop_state()
        self._end_step()

    def shutdown(self) -> None:
        self._shutdown = True

    def close(self, drain_timeout_s: float | None = None) -> None:
        """Stop the cache's storage threads (writing what is queued, for at most
        `drain_timeout_s`) and the forward stream's worker (overlap on a CPU)."""
        self.tree_cache.close(drain_timeout_s)
        self.model_worker.close()

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
        """Test helper: step (the loop's code path) until idle; the steps run, or raises."""
        for step in range(1, max_steps + 1):
            self.process_input_requests(self.recv_requests(block=False))
            batch = self.run_step()
            if batch is None and self.is_idle() and not getattr(self.io, "inbox", None):
                return step
        raise RuntimeError(f"scheduler not idle after {max_steps} steps: {self.get_internal_state()}")
