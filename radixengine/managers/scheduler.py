"""Scheduler: continuous batching over the radix cache.

One step: recv → `process_input_requests` (validate, build `Req`, queue) → `get_next_batch_to_run`
(prefill first; else the running decode batch, after `update_running_batch`, which may retract)
→ `run_batch` (ScheduleBatch → ModelWorkerBatch → forward → sample) → `process_batch_result`
(append tokens, check stop conditions, cache or free KV) → one `BatchTokenIDOut` for the step.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from radixengine.managers.fair_policy import FairPolicy
from radixengine.managers.grammar_manager import GrammarManager
from radixengine.managers.io_struct import (
    INIT_INCREMENTAL_DETOKENIZATION_OFFSET,
    AbortReq,
    BatchTokenIDOut,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    LogprobOutputs,
    TokenizedGenerateReqInput,
    finish_length,
)
from radixengine.managers.overlap_utils import FutureMap, StepTimer, write_chrome_trace
from radixengine.managers.schedule_batch import Req, ScheduleBatch
from radixengine.managers.schedule_policy import (
    IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD,
    AddReqResult,
    PrefillAdder,
    PrefixTrie,
    SchedulePolicy,
    lowest_priority_value,
)
from radixengine.managers.scheduler_io import InProcessIO, SchedulerIO, SchedulerIOClosed
from radixengine.mem_cache.accounting import TokenAccountingError, check_token_accounting
from radixengine.mem_cache.chunk_cache import ChunkCache
from radixengine.mem_cache.radix_cache import RadixCache
from radixengine.server_args import ServerArgs
from radixengine.utils.streams import CpuStream, CudaStream, HostStream, get_default_stream, new_stream

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    num_prefill_tokens: int = 0  # prompt tokens computed (KV written by a prefill)
    num_cached_tokens: int = 0  # prompt tokens served from the cache
    num_generated_tokens: int = 0
    num_retracted_reqs: int = 0
    num_preempted_reqs: int = 0
    num_forward_steps: int = 0

    @property
    def cache_hit_rate(self) -> float:
        total = self.num_prefill_tokens + self.num_cached_tokens
        return self.num_cached_tokens / total if total else 0.0


class Scheduler:
    def __init__(
        self,
        server_args: ServerArgs,
        tp_worker: Any = None,
        tokenizer: Any = None,
        io: SchedulerIO | None = None,
    ) -> None:
        self.server_args = server_args
        if tp_worker is None:
            from radixengine.managers.tp_worker import TpModelWorker

            tp_worker = TpModelWorker(server_args)
        self.tp_worker = tp_worker
        self.tokenizer = tokenizer
        self.io: SchedulerIO = io if io is not None else InProcessIO()
        self.page_size = server_args.page_size
        self.enable_overlap = not server_args.disable_overlap_schedule

        self._init_worker_info()
        self._init_memory_and_cache()
        self.grammar_manager = GrammarManager(server_args, tokenizer, self.vocab_size, self.eos_token_ids)
        args = server_args
        self.enable_in_batch_prefix_caching = (
            not args.disable_in_batch_prefix_caching and not self.tree_cache.disable
        )
        self.policy = SchedulePolicy(
            args.schedule_policy,
            self.tree_cache,
            enable_priority_scheduling=args.enable_priority_scheduling,
            schedule_low_priority_values_first=args.schedule_low_priority_values_first,
            lpm_fallback_queue_len=args.lpm_fallback_queue_len,
            enable_in_batch_prefix_caching=self.enable_in_batch_prefix_caching,
            fair=FairPolicy(args.lpm_aging_tokens_per_pass, args.dlpm_quantum_tokens),
        )
        self.try_preemption = args.enable_priority_scheduling
        self.enable_mixed_chunk = args.enable_mixed_chunk
        self.stream_interval = args.stream_interval
        self.chunked_prefill_size = args.effective_chunked_prefill_size
        self.max_prefill_tokens = args.max_prefill_tokens

        self.init_new_token_ratio = args.init_ratio
        self.min_new_token_ratio = args.min_ratio
        self.new_token_ratio_decay = args.ratio_decay
        self.new_token_ratio = self.init_new_token_ratio

        self.waiting_queue: list[Req] = []
        self.running_batch: ScheduleBatch = self._new_batch([])
        self.cur_batch: ScheduleBatch | None = None
        self.last_batch: ScheduleBatch | None = None
        self.chunked_req: Req | None = None
        self.stats = SchedulerStats()
        self._pending_outputs: list[Req] = []
        self._deferred_requests: list[object] = []
        self._shutdown = False
        self.timer = StepTimer(trace=args.trace_file is not None)
        self.step_ct = 0  # event-loop steps run (the watchdog's progress counter)
        self.forward_ct_decode = 0
        self.last_prefill_stats_tic = self.last_decode_stats_tic = time.perf_counter()
        self.generated_at_last_decode_log = 0
        self.last_gen_throughput = 0.0
        self._trace_written_at = time.perf_counter()
        # Launched batches whose results are not processed yet (at most two, under overlap).
        self.result_queue: deque[tuple[ScheduleBatch, Any]] = deque()
        if self.enable_overlap:
            self.init_overlap()

    def init_overlap(self) -> None:
        layout = self.server_args.cpu_forward_stream
        self.forward_stream = new_stream(self.device, "forward", cpu_layout=layout)
        if isinstance(self.forward_stream, HostStream):
            # The forward's threads use every core: nothing can run alongside it, so launching
            # N before processing N-1 would only cost a stale step. Keep the normal step order.
            logger.info(
                "overlap schedule: --cpu-forward-stream %s runs the CPU forward inline; running the normal step order",
                layout,
            )
            self.enable_overlap = False
            return
        if isinstance(self.forward_stream, CpuStream):
            logger.info(
                "overlap schedule: --cpu-forward-stream %s runs the CPU forward on a worker thread", layout
            )
            weakref.finalize(self, self.forward_stream.close)
        elif self.server_args.trace_file and isinstance(self.forward_stream, CudaStream):
            self.forward_stream.enable_timing()
        self.default_stream = get_default_stream(self.device)
        self.future_map = FutureMap(self.req_to_token_pool.size, self.device)
        # Keeps the inputs of the last two launched batches alive while the device reads them.
        self.batch_record_buf: deque[Any] = deque(maxlen=2)

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
            self.tree_cache = RadixCache(*pools, eviction_policy=self.server_args.radix_eviction_policy)

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

    # Input -------------------------------------------------------------------------------------

    def recv_requests(self, block: bool = False) -> list[object]:
        return self.io.recv(block)

    def process_input_requests(self, msgs: list[object]) -> None:
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReqInput):
                self.handle_generate_request(msg)
            elif isinstance(msg, AbortReq):
                self.abort_request(msg.rid)
            elif isinstance(msg, (FlushCacheReqInput, GetInternalStateReq)):
                # Answered at the end of the step, once its results are processed (under overlap
                # a finished request's last, one-step-late slot is freed only then).
                self._deferred_requests.append(msg)
            else:
                logger.error("scheduler: ignoring a message of unknown type %s", type(msg).__name__)

    def handle_generate_request(self, recv: TokenizedGenerateReqInput) -> None:
        req = Req(
            recv.rid,
            recv.input_text,
            recv.input_ids,
            recv.sampling_params,
            return_logprob=recv.return_logprob,
            top_logprobs_num=recv.top_logprobs_num,
            stream=recv.stream,
            priority=recv.priority,
            logprob_start_len=recv.logprob_start_len if recv.return_logprob else -1,
            routing_key=recv.routing_key,
        )
        req.init_stop_str_window(self.tokenizer)
        if self.server_args.enable_priority_scheduling and req.priority is None:
            req.priority = lowest_priority_value(self.server_args.schedule_low_priority_values_first)
        error = recv.error or self._validate_request(req)
        if error is None and req.sampling_params.grammar_key is not None:
            error = self.grammar_manager.process_req_with_grammar(req)
            if error is None and isinstance(req.grammar, Future):
                return  # in the grammar queue until its grammar compiles
        if error is not None:
            self._finish_at_once(req, error, 400)
            return
        self._add_request_to_queue(req)

    def move_ready_grammar_requests(self) -> None:
        """Requests whose grammar has compiled join the waiting queue (or fail with a 400). When
        nothing else can run, wait a little for a compile instead of spinning."""
        nothing_else = (
            not self.waiting_queue
            and self.running_batch.is_empty()
            and self.chunked_req is None
            and not self.result_queue
        )
        for req, error in self.grammar_manager.get_ready_grammar_requests(block=nothing_else):
            if error is not None:
                self._finish_at_once(req, error, 400)
            else:
                self._add_request_to_queue(req)

    def _validate_request(self, req: Req) -> str | None:
        try:
            req.sampling_params.verify(self.vocab_size)
        except ValueError as e:
            return f"Invalid sampling parameters: {e}"
        ids = req.origin_input_ids
        n = len(ids)
        if n == 0:
            return "The prompt is empty: at least one input token is required."
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            return f"Input token id {bad} is outside the vocabulary [0, {self.vocab_size})."
        if n >= self.max_req_input_len:
            return (
                f"The input ({n} tokens) is longer than the model's context length allows "
                f"(at most {self.max_req_input_len - 1} input tokens)."
            )
        max_new = req.sampling_params.max_new_tokens
        if req.return_logprob and not 0 <= req.logprob_start_len <= n:
            return (
                f"logprob_start_len {req.logprob_start_len} must be -1 or in [0, {n}] (the input's length)."
            )
        if n + max_new > self.max_req_len:
            return (
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.max_req_len} tokens: {n} input tokens + max_new_tokens {max_new} = {n + max_new}. "
                f"Reduce the prompt or max_new_tokens."
            )
        return None

    def _finish_at_once(self, req: Req, message: str, status_code: int) -> None:
        err_type = "ServiceUnavailableError" if status_code == 503 else "BadRequestError"
        req.abort(message, status_code, err_type)
        req.time_stats.finish_time = time.perf_counter()
        self._pending_outputs.append(req)

    def _priority_key(self, req: Req) -> tuple[int, float]:
        """Ascending = more important first; ties: earlier arrival first."""
        sign = 1 if self.server_args.schedule_low_priority_values_first else -1
        return req.priority * sign, req.time_stats.wait_queue_entry_time

    def _add_request_to_queue(self, req: Req) -> None:
        req.time_stats.wait_queue_entry_time = time.perf_counter()
        limit = self.server_args.max_queued_requests
        if limit is not None and len(self.waiting_queue) >= limit:
            if not self.server_args.enable_priority_scheduling:
                self._finish_at_once(req, "The request queue is full.", 503)
                return
            worst = max(self.waiting_queue, key=self._priority_key)
            if self._priority_key(req)[0] >= self._priority_key(worst)[0]:
                self._finish_at_once(req, "The request queue is full.", 503)
                return
            self.waiting_queue.remove(worst)
            self._finish_at_once(worst, "The request is aborted by a higher priority request.", 503)
        self.waiting_queue.append(req)

    def _requeue(self, reqs: list[Req]) -> None:
        """Retracted or preempted requests go back to the waiting queue (no queue limit)."""
        for req in reqs:
            if req.to_abort:
                req.check_finished(self.eos_token_ids)
                self._pending_outputs.append(req)
            else:
                self.waiting_queue.append(req)

    # Scheduling --------------------------------------------------------------------------------

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        if len(self.grammar_manager):
            self.move_ready_grammar_requests()
        last = self.last_batch
        if (
            self.chunked_req is not None
            and last is not None
            and any(r is self.chunked_req for r in last.reqs)
        ):
            if self.chunked_req.to_abort:
                self._release_aborted_chunked_req(in_last_batch=True)
            else:
                # Hand the chunk to the cache; the request keeps its row for the next chunk.
                self.tree_cache.cache_unfinished_req(self.chunked_req, chunked=True)
        elif self.chunked_req is not None and self.chunked_req.to_abort:
            self._release_aborted_chunked_req(in_last_batch=False)

        if last is not None and last.forward_mode.is_extend():
            launched_bs = last.batch_size()
            last.filter_batch(chunked_req_to_exclude=self.chunked_req)
            if last.batch_size() < launched_bs:
                self.running_batch.batch_is_full = False
            if not last.is_empty():
                if self.running_batch.is_empty():
                    last.batch_is_full = self.running_batch.batch_is_full
                    self.running_batch = last
                else:
                    self.running_batch.merge_batch(last)

        new_batch = self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        if self.running_batch.is_empty():
            return None
        self.running_batch = self.update_running_batch(self.running_batch)
        return None if self.running_batch.is_empty() else self.running_batch

    def _num_allocatable_reqs(self, running_bs: int, chunked_in_batch: bool = False) -> int:
        """How many requests this prefill batch may hold (the chunked request keeps its row)."""
        rows = self.req_to_token_pool.available_size() + int(chunked_in_batch)
        return min(self.max_running_requests - running_bs, rows)

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        running = self.running_batch
        if self.try_preemption or running.is_empty():  # nothing running would ever reset it
            running.batch_is_full = False
        if (running.batch_is_full or not self.waiting_queue) and self.chunked_req is None:
            return None
        if (
            self._num_allocatable_reqs(len(running.reqs)) <= 0
            and self.chunked_req is None
            and not self.try_preemption
        ):
            running.batch_is_full = True
            return None

        prefix_computed = self.policy.calc_priority(self.waiting_queue) if self.waiting_queue else False
        adder = PrefillAdder(
            self.page_size,
            self.tree_cache,
            self.token_to_kv_pool_allocator,
            running,
            self.new_token_ratio,
            self.max_prefill_tokens,
            self.chunked_prefill_size,
            mixed_with_decode_tokens=len(running.reqs) if self.enable_mixed_chunk else 0,
            priority_scheduling_preemption_threshold=self.server_args.priority_scheduling_preemption_threshold,
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        trie = self._in_batch_prefix_trie(adder.can_run_list)
        chunked_in_batch = bool(adder.can_run_list)

        for req in self.waiting_queue:
            # A preemption may have evicted the node an earlier match (calc_priority's) returned.
            rematch = not prefix_computed or bool(adder.preempt_list)
            req.init_next_round_input(self.tree_cache if rematch else None)
            if trie is not None and self._prefix_being_computed(req, trie):
                continue  # wait one round: it will hit the cache instead of computing it again
            if len(adder.can_run_list) >= self._num_allocatable_reqs(len(running.reqs), chunked_in_batch):
                running.batch_is_full = True
            if running.batch_is_full and not self._preempt_for(adder, req):
                break
            res = adder.add_one_req(req, has_chunked_req=self.chunked_req is not None)
            if (
                res == AddReqResult.NO_TOKEN
                and req not in adder.can_run_list
                and self._preempt_for(adder, req)
            ):
                res = adder.add_one_req(req, has_chunked_req=self.chunked_req is not None)
            if trie is not None and adder.can_run_list and adder.can_run_list[-1] is req:
                trie.insert(req.fill_ids)
            if res != AddReqResult.CONTINUE:
                if res == AddReqResult.NO_TOKEN:
                    running.batch_is_full = True
                break

        can_run = adder.can_run_list
        if adder.preempt_list:
            self.stats.num_preempted_reqs += len(adder.preempt_list)
        if not can_run:
            self._requeue(adder.preempt_list)
            return None
        admitted = {id(r) for r in can_run}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        self._requeue(adder.preempt_list)
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.is_chunked += 1

        self.log_prefill_stats(adder, len(running.reqs))
        batch = self._new_batch(can_run)
        cached_before = sum(r.cached_tokens for r in can_run)
        batch.prepare_for_extend()
        self.policy.fair.on_prefill_batch(can_run)
        self.stats.num_cached_tokens += sum(r.cached_tokens for r in can_run) - cached_before
        self.stats.num_prefill_tokens += batch.extend_num_tokens
        if self.enable_mixed_chunk:
            self._mix_running_into(batch)
        return batch

    # Log lines (SGLang's wording and fields) ----------------------------------------------------

    def _token_usage(self) -> tuple[int, float]:
        """KV slots in use (neither free nor evictable cache) and their share of the pool."""
        free = self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size()
        used = self.max_total_num_tokens - free
        return used, used / self.max_total_num_tokens

    def _graph_label(self, batch: ScheduleBatch | None) -> str:
        """SGLang's `cuda graph: <bool>` field: whether the model runner replays a graph for it."""
        runner = getattr(self.tp_worker, "model_runner", None)
        graph = getattr(runner, "cuda_graph_runner", None)
        can_run = (
            graph is not None
            and batch is not None
            and batch.forward_mode.is_decode()
            and 0 < batch.batch_size() <= graph.max_bs
        )
        return f"{'cpu' if self.device.type == 'cpu' else 'cuda'} graph: {can_run}"

    def log_prefill_stats(self, adder: PrefillAdder, running_bs: int) -> None:
        """Every prefill batch; its input throughput is its new tokens over the time since the
        previous prefill batch."""
        if not logger.isEnabledFor(logging.INFO):
            return
        now = time.perf_counter()
        gap, self.last_prefill_stats_tic = now - self.last_prefill_stats_tic, now
        _, usage = self._token_usage()
        logger.info(
            "Prefill batch, #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d, #pending-token: %d, %s, input throughput (token/s): %.2f",
            len(adder.can_run_list),
            adder.log_input_tokens,
            adder.log_hit_tokens,
            usage,
            running_bs,
            len(self.waiting_queue),
            sum(len(r.origin_input_ids) + len(r.output_ids) for r in self.waiting_queue),
            self._graph_label(None),
            adder.log_input_tokens / gap if gap > 0 else 0.0,
        )

    def log_decode_stats(self, batch: ScheduleBatch) -> None:
        """Every `--decode-log-interval` decode steps: the line, and `gen_throughput` (the tokens
        sampled since the previous line over the time since it)."""
        self.forward_ct_decode += 1
        if self.forward_ct_decode % self.server_args.decode_log_interval:
            return
        now = time.perf_counter()
        generated = self.stats.num_generated_tokens - self.generated_at_last_decode_log
        gap = now - self.last_decode_stats_tic
        self.last_gen_throughput = generated / gap if gap > 0 else 0.0
        self.last_decode_stats_tic, self.generated_at_last_decode_log = now, self.stats.num_generated_tokens
        if not logger.isEnabledFor(logging.INFO):
            return
        used, usage = self._token_usage()
        logger.info(
            "Decode batch, #running-req: %d, #token: %d, token usage: %.2f, %s, "
            "gen throughput (token/s): %.2f, #queue-req: %d",
            batch.batch_size(),
            used,
            usage,
            self._graph_label(batch),
            self.last_gen_throughput,
            len(self.waiting_queue),
        )

    def _reset_decode_stats(self) -> None:
        """Idle: nothing is generated (SGLang reports gen_throughput 0), and the next interval
        starts when work does."""
        self.last_gen_throughput = 0.0
        self.forward_ct_decode = 0
        self.last_decode_stats_tic = time.perf_counter()
        self.generated_at_last_decode_log = self.stats.num_generated_tokens

    def _mix_running_into(self, batch: ScheduleBatch) -> None:
        """Mixed chunked prefill: the running requests take their decode step inside this prefill
        batch. Not with logprobs, and not when the decode step would not fit (then decode runs
        on its own next, where it can retract)."""
        running = self.running_batch
        if running.is_empty() or batch.return_logprob or running.return_logprob:
            return
        launched_bs = running.batch_size()
        running.filter_batch()
        if running.batch_size() < launched_bs:
            running.batch_is_full = False  # finished requests freed rows, as in update_running_batch
        if running.is_empty() or not running.check_decode_mem():
            return
        running.prepare_for_decode()
        batch.mix_with_running(running)
        self.running_batch = self._new_batch([])
        self.running_batch.batch_is_full = running.batch_is_full

    def _preempt_for(self, adder: PrefillAdder, req: Req) -> bool:
        """Preempt running requests to make room for `req` (priority scheduling only). Releasing
        them can evict the tree node `req` matched, so `req` is matched again before it is added."""
        if not (self.try_preemption and adder.preempt_to_schedule(req, self.server_args)):
            return False
        req.init_next_round_input(self.tree_cache)
        return True

    def _in_batch_prefix_trie(self, admitted: list[Req]) -> PrefixTrie | None:
        """What this round (and any batch still in flight) is about to compute."""
        if not self.enable_in_batch_prefix_caching:
            return None
        trie = PrefixTrie()
        for req in (*self._inflight_prefill_reqs(), *admitted):
            trie.insert(req.fill_ids)
        return trie

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

    def _prefix_being_computed(self, req: Req, trie: PrefixTrie) -> bool:
        shared = trie.match(req.fill_ids[: req.max_prefix_len()])
        shared = shared // self.page_size * self.page_size
        return shared - len(req.prefix_indices) >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD

    def update_running_batch(self, batch: ScheduleBatch) -> ScheduleBatch:
        # Measured before the filter: requests that finished last step free their rows and
        # tokens, and the next prefill round must see it (else batching turns static).
        initial_bs = batch.batch_size()
        batch.filter_batch()
        if batch.is_empty():
            batch.batch_is_full = False
            return batch
        if not batch.check_decode_mem():
            old_ratio = self.new_token_ratio
            retracted, new_ratio, aborted = batch.retract_decode(self.server_args)
            # An empty batch (its last request aborted) keeps the ratio: nothing to estimate from.
            self.new_token_ratio = new_ratio if not batch.is_empty() else old_ratio
            for req in aborted:
                req.time_stats.finish_time = time.perf_counter()
                self._pending_outputs.append(req)
                logger.warning("retract_decode: aborted the last request %s: out of KV memory", req.rid)
            self.stats.num_retracted_reqs += len(retracted)
            logger.info(
                "KV cache pool is full. Retract requests. #retracted_reqs: %d, #new_token_ratio: %.4f -> %.4f",
                len(retracted),
                old_ratio,
                self.new_token_ratio,
            )
            self._requeue(retracted)
        else:
            self.new_token_ratio = max(
                self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio
            )
        if batch.batch_size() < initial_bs:
            batch.batch_is_full = False
        if not batch.is_empty():
            batch.prepare_for_decode()
        return batch

    # Running -----------------------------------------------------------------------------------

    def run_batch(self, batch: ScheduleBatch) -> Any:
        self.stats.num_forward_steps += 1
        mwb = batch.get_model_worker_batch()
        if not self.enable_overlap:
            if batch.has_grammar:
                self.update_vocab_mask(batch, mwb)
            with self.timer.phase("forward"):
                result = self.tp_worker.forward_batch_generation(mwb)
            batch.output_ids = result.next_token_ids
            return result
        # Overlap: launch on the forward stream and return at once; the next batch takes this
        # one's tokens as placeholders, resolved on the stream from the FutureMap. With a grammar
        # the sample waits (`launch_batch_sample_if_needed`): its mask needs the tokens of the
        # batch processed while this forward runs.
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

    def update_vocab_mask(self, batch: ScheduleBatch, mwb: Any) -> None:
        """This step's allowed-token masks of the batch's constrained rows, filled on the host from
        each matcher's state (SGLang's update_regex_vocab_mask)."""
        with self.timer.phase("grammar"):
            grammars = [r.samples_grammar() for r in batch.reqs]
            mwb.sampling_info.update_regex_vocab_mask(
                grammars, self.vocab_size, pin_memory=self.device.type == "cuda"
            )

    def launch_batch_sample_if_needed(self, result: Any) -> None:
        """Overlap, a batch with a grammar: fill its masks now that the previous batch's tokens
        are accepted (while its forward still runs), then sample it on the forward stream."""
        pending = getattr(result, "delayed_sample", None)
        if pending is None:
            return
        result.delayed_sample = None
        batch, mwb = pending
        self.update_vocab_mask(batch, mwb)
        self.forward_stream.submit(self._sample_on_stream, batch.req_pool_indices, result, label="sample")
        result.copy_done = self.forward_stream.record_event()

    def _forward_on_stream(
        self, mwb: Any, req_pool_indices: torch.Tensor, result: OverlapResult, delay_sample: bool = False
    ) -> None:
        mwb.input_ids = self.future_map.resolve_future(mwb.input_ids)
        if delay_sample:
            result.forward_out = self.tp_worker.forward_batch_generation(mwb, delay_sample=True)
            return
        out = self.tp_worker.forward_batch_generation(mwb)
        self._publish_on_stream(out, req_pool_indices, result)

    def _sample_on_stream(self, req_pool_indices: torch.Tensor, result: OverlapResult) -> None:
        out, result.forward_out = result.forward_out, None
        if out is None:
            raise RuntimeError("the forward of a batch with a delayed sample did not run")
        self._publish_on_stream(out.delay_sample_func(), req_pool_indices, result)

    def _publish_on_stream(self, out: Any, req_pool_indices: torch.Tensor, result: OverlapResult) -> None:
        self.future_map.store_to_map(req_pool_indices, out.next_token_ids)
        result.next_token_ids = _to_host(out.next_token_ids)
        for name in _OPTIONAL_RESULTS:
            value = getattr(out, name)
            if value is not None:
                setattr(result, name, _to_host(value))

    def process_batch_result(self, batch: ScheduleBatch, result: Any) -> None:
        if batch.forward_mode.is_decode():
            self.process_batch_result_decode(batch, result)
        elif batch.forward_mode.is_extend():
            self.process_batch_result_prefill(batch, result)

    def _host_results(self, batch: ScheduleBatch, result: Any) -> HostResults:
        copy_done = getattr(result, "copy_done", None)
        if copy_done is not None:
            with self.timer.phase("wait"):
                copy_done.synchronize()  # raises if the forward failed
        invalid = frozenset()
        if result.invalid_rows is not None:
            invalid = frozenset(result.invalid_rows.nonzero().view(-1).tolist())
        res = HostResults(result.next_token_ids.tolist(), None, invalid)
        if batch.return_logprob:
            res.logprobs = _tolist(result.next_token_logprobs)
            res.top_val = _tolist(result.next_token_top_logprobs_val)
            res.top_idx = _tolist(result.next_token_top_logprobs_idx)
            res.input_logprobs = _tolist(result.input_token_logprobs)
            res.input_top_val = _tolist(result.input_top_logprobs_val)
            res.input_top_idx = _tolist(result.input_top_logprobs_idx)
        return res

    def _append_token(self, req: Req, token: int, res: HostResults, row: int) -> None:
        if req.sampling_params.max_new_tokens == 0:  # prefill only
            req.finished_reason = finish_length(0)
            return
        req.output_ids.append(token)
        if req.grammar is not None:
            self._accept_grammar_token(req, token)
        if req.return_logprob and res.logprobs is not None:
            k = req.top_logprobs_num
            top_val = res.top_val[row][:k] if k and res.top_val is not None else None
            top_idx = res.top_idx[row][:k] if k and res.top_idx is not None else None
            req.append_output_logprobs(res.logprobs[row], top_val, top_idx)
        self.stats.num_generated_tokens += 1
        if len(req.output_ids) == 1:
            req.time_stats.first_token_time = time.perf_counter()
        req.check_finished(self.eos_token_ids, self.tokenizer)

    def _accept_grammar_token(self, req: Req, token: int) -> None:
        try:
            req.grammar.accept_token(token)
        except ValueError as e:  # a token the mask did not allow: fail this request alone
            logger.error("request %s: %s; aborting it", req.rid, e)
            req.abort(f"Constrained decoding failed: {e}", 500, "InternalServerError")

    def _finish_req(self, req: Req) -> None:
        req.time_stats.finish_time = time.perf_counter()
        self.tree_cache.cache_finished_req(req)

    def _take_result(self, req: Req, res: HostResults, row: int, batch: ScheduleBatch) -> None:
        """Append the token sampled for `row` to `req` and finish it if it stops; a row whose
        logits had nothing to sample (all NaN or -inf) fails that request alone."""
        if row in res.invalid_rows:
            logger.error("request %s: the model's logits are all NaN or -inf; aborting it", req.rid)
            req.abort(
                "The model produced no finite logits (all NaN or -inf) for this request.",
                500,
                "InternalServerError",
            )
            req.time_stats.finish_time = time.perf_counter()
            # Its KV covers every token this batch computed (no new token is appended) and may
            # hold NaN: freed, not inserted.
            with req.as_prefilled_upto(int(batch.seq_lens_cpu[row])):
                self.tree_cache.cache_finished_req(req, is_insert=False)
            return
        self._append_token(req, res.next_ids[row], res, row)
        if req.finished():
            self._finish_req(req)

    def process_batch_result_prefill(self, batch: ScheduleBatch, result: Any) -> None:
        res = self._host_results(batch, result)
        stale: list[int] = []
        input_offsets = _offsets(batch.input_logprob_counts)
        for i, req in enumerate(batch.reqs):
            decoding = batch.is_decoding_req(i)  # a MIXED batch's decode step
            if input_offsets is not None and not (req.is_retracted or req.finished()):
                self._add_input_logprobs(req, res, input_offsets[i], input_offsets[i + 1])
            if req.is_retracted or req.finished():
                # Overlap only: retracted while this batch ran (a re-prefill holds one slot more
                # than cache_finished_req freed, its last output token's), or a decode step of a
                # request that finished one step earlier.
                if (req.is_retracted and req.output_ids) or decoding:
                    stale.append(i)
                continue
            if req.is_chunked > 0:
                req.is_chunked -= 1  # a partial prefill: its token is not an output
                continue
            if req.return_logprob and not decoding:
                req.finish_input_logprobs()
            self._take_result(req, res, i, batch)
            if not req.finished() and not decoding:
                self.tree_cache.cache_unfinished_req(req)
            self._pending_outputs.append(req)
        self._free_stale_slots(batch, stale)

    @staticmethod
    def _add_input_logprobs(req: Req, res: HostResults, start: int, end: int) -> None:
        if start == end or res.input_logprobs is None:
            return
        top_val = top_idx = None
        if req.top_logprobs_num and res.input_top_val is not None:
            k = req.top_logprobs_num
            top_val = [v[:k] for v in res.input_top_val[start:end]]
            top_idx = [v[:k] for v in res.input_top_idx[start:end]]
        req.add_input_logprobs(res.input_logprobs[start:end], top_val, top_idx)

    def process_batch_result_decode(self, batch: ScheduleBatch, result: Any) -> None:
        res = self._host_results(batch, result)
        allocator = self.token_to_kv_pool_allocator
        allocator.free_group_begin()
        stale: list[int] = []
        for i, req in enumerate(batch.reqs):
            if req.is_retracted or req.finished():
                stale.append(i)  # overlap only: it finished (or was retracted) one step earlier
                continue
            self._take_result(req, res, i, batch)
            self._pending_outputs.append(req)
        self._free_stale_slots(batch, stale)
        allocator.free_group_end()
        self.log_decode_stats(batch)

    def _free_stale_slots(self, batch: ScheduleBatch, stale: list[int]) -> None:
        """Free the one slot this batch allocated for each request that was already released:
        with pages, only when that slot opened a page of its own (else the page went with the
        request's last page)."""
        if not stale:
            return
        idx = torch.tensor(stale, dtype=torch.int64)
        slot_pos = batch.seq_lens_cpu[idx] - 1
        if batch.forward_mode.is_extend():  # each request's last new token
            last = torch.tensor(batch.extend_lens, dtype=torch.int64).cumsum(0) - 1
            locs = batch.out_cache_loc[last[idx].to(batch.out_cache_loc.device)]
        else:
            locs = batch.out_cache_loc[idx.to(batch.out_cache_loc.device)]
        if self.page_size > 1:
            locs = locs[(slot_pos % self.page_size == 0).to(locs.device)]
        self.token_to_kv_pool_allocator.free(locs)

    def stream_output(self) -> None:
        """One BatchTokenIDOut for every request that got a token, finished or failed this step.
        Per request only what is new since its previous message (ids, logprobs): a long
        generation costs the same per step. Output ids survive retraction, so the offset does.
        A streaming request is sent its first token at once, then every `--stream-interval` tokens
        (what it was not sent waits in its output ids), and always when it finishes."""
        reqs = [
            r for r in dict.fromkeys(self._pending_outputs) if self._should_send(r)
        ]  # once each, in order
        self._pending_outputs = []
        if not reqs:
            return
        new_ids, tails = [], []
        logprobs = LogprobOutputs() if any(r.return_logprob for r in reqs) else None
        for r in reqs:
            start = r.send_token_offset
            new_ids.append(r.output_ids[start:])
            tails.append(r.origin_input_ids[-INIT_INCREMENTAL_DETOKENIZATION_OFFSET:] if start == 0 else None)
            if logprobs is not None:
                _add_logprob_outputs(logprobs, r, start)
            r.send_token_offset = len(r.output_ids)
        self.io.send(
            BatchTokenIDOut(
                rids=[r.rid for r in reqs],
                finished_reasons=[r.finished_reason for r in reqs],
                output_ids=new_ids,
                prompt_tail_ids=tails,
                prompt_tokens=[len(r.origin_input_ids) for r in reqs],
                cached_tokens=[r.cached_tokens for r in reqs],
                skip_special_tokens=[r.sampling_params.skip_special_tokens for r in reqs],
                no_stop_trim=[r.sampling_params.no_stop_trim for r in reqs],
                queue_times=[_queue_time(r) for r in reqs],
                **(logprobs.logprob_outputs() if logprobs is not None else {}),
            )
        )

    def _should_send(self, req: Req) -> bool:
        if req.finished() or self.stream_interval == 1 or not req.stream:
            return True
        return len(req.output_ids) % self.stream_interval == 1

    # Abort, flush, state -----------------------------------------------------------------------

    def abort_request(self, rid: str) -> None:
        req = self.grammar_manager.abort_request(rid)
        if req is not None:
            req.to_abort = True
            req.check_finished(self.eos_token_ids)
            req.time_stats.finish_time = time.perf_counter()
            self._pending_outputs.append(req)
            return
        for i, req in enumerate(self.waiting_queue):
            if req.rid == rid:
                del self.waiting_queue[i]
                req.to_abort = True
                req.check_finished(self.eos_token_ids)
                req.time_stats.finish_time = time.perf_counter()
                self._pending_outputs.append(req)
                return
        for req in self._active_reqs():
            if req.rid == rid and not req.finished():
                req.to_abort = True  # finished at its next result, which frees its KV

    def _active_reqs(self) -> list[Req]:
        reqs = list(self.running_batch.reqs)
        for batch in (self.last_batch, self.cur_batch):
            if batch is not None:
                reqs.extend(batch.reqs)
        if self.chunked_req is not None:
            reqs.append(self.chunked_req)
        return reqs

    def _release_aborted_chunked_req(self, in_last_batch: bool) -> None:
        """Finish a request aborted between chunks: its KV covers the chunks computed so far."""
        req, self.chunked_req = self.chunked_req, None
        kv_len = len(req.fill_ids) if in_last_batch else len(req.prefix_indices)
        req.is_chunked = 0
        req.check_finished(self.eos_token_ids)
        req.time_stats.finish_time = time.perf_counter()
        if req.req_pool_idx is not None:
            # Not inserted: under overlap its last chunk may still be computing.
            with req.as_prefilled_upto(kv_len):
                self.tree_cache.cache_finished_req(req, is_insert=False)
        self._pending_outputs.append(req)

    def flush_cache(self) -> bool:
        return self._flush_cache()[0]

    def _flush_cache(self) -> tuple[bool, str]:
        if not self.is_idle():
            running = sum(1 for r in set(self._active_reqs()) if not r.finished())
            message = f"Cache not flushed: {running} running and {len(self.waiting_queue)} waiting requests."
            logger.warning(message)
            return False, message
        self.tree_cache.reset()
        self.grammar_manager.reset()
        self.req_to_token_pool.clear()
        self.token_to_kv_pool_allocator.clear()
        self.last_batch = self.cur_batch = None
        self.running_batch = self._new_batch([])
        self.new_token_ratio = self.init_new_token_ratio
        return True, "Cache flushed."

    def get_internal_state(self) -> dict:
        available = self.token_to_kv_pool_allocator.available_size()
        evictable = self.tree_cache.evictable_size()
        s = self.stats
        return {
            "num_running_reqs": len({id(r) for r in self._active_reqs() if not r.finished()}),
            "num_queue_reqs": len(self.waiting_queue),
            "num_grammar_queue_reqs": len(self.grammar_manager),
            "num_queue_tokens": sum(r.seqlen for r in self.waiting_queue),  # /v1/loads
            "num_retracted_reqs": s.num_retracted_reqs,
            "num_preempted_reqs": s.num_preempted_reqs,
            "num_prefill_tokens": s.num_prefill_tokens,
            "num_cached_tokens": s.num_cached_tokens,
            "num_generated_tokens": s.num_generated_tokens,
            "num_forward_steps": s.num_forward_steps,
            "max_total_tokens": self.max_total_num_tokens,
            "available_tokens": available,
            "evictable_tokens": evictable,
            "protected_tokens": self.tree_cache.protected_size(),
            "token_usage": 1.0 - (available + evictable) / self.max_total_num_tokens,
            "cache_hit_rate": s.cache_hit_rate,
            "new_token_ratio": self.new_token_ratio,
            "gen_throughput": self.last_gen_throughput,
        }

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
            self.launch_batch_sample_if_needed(result)
        self.last_batch = batch
        self._end_step()
        return batch

    def _answer_deferred_requests(self) -> None:
        msgs, self._deferred_requests = self._deferred_requests, []
        for msg in msgs:
            if isinstance(msg, FlushCacheReqInput):
                ok, message = self._flush_cache()
                self.io.send(FlushCacheReqOutput(success=ok, message=message))
            else:
                self.io.send(GetInternalStateReqOutput(state=self.get_internal_state()))

    def _end_step(self) -> None:
        self.step_ct += 1
        self.stream_output()
        self._answer_deferred_requests()
        self.timer.end_step()
        if self.server_args.trace_file and time.perf_counter() - self._trace_written_at > 5.0:
            self.write_trace()

    def _recv_and_process(self) -> None:
        with self.timer.phase("recv"):
            msgs = self.recv_requests(block=self.is_idle())
            self.process_input_requests(msgs)

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
                    self._recv_and_process()
                except SchedulerIOClosed:
                    return
                self.run_step()
        finally:
            if self.server_args.trace_file:
                self.write_trace()

    def shutdown(self) -> None:
        self._shutdown = True

    def close(self) -> None:
        """Stop the forward stream's worker (overlap on a CPU)."""
        stream = getattr(self, "forward_stream", None)
        if isinstance(stream, CpuStream):
            stream.close()

    def write_trace(self, path: str | None = None) -> None:
        """Chrome trace of the scheduler's phases and the forward stream's busy intervals."""
        path = path or self.server_args.trace_file
        if path is None or self.timer.events is None:
            return
        stream = getattr(self, "forward_stream", None)
        if self.enable_overlap:
            device = list(stream.busy)  # CpuStream, HostStream (inline) or CudaStream (timed)
        else:  # the forward runs inline: it is the device lane
            device = [(s, e, "forward") for name, s, e in self.timer.events if name == "forward"]
        write_chrome_trace(path, list(self.timer.events), device, self.timer.start_time)
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


def _tokenizer_eos(tokenizer: Any) -> frozenset[int]:
    """The tokenizer's own EOS id (SGLang adds it to the model's EOS set)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset() if eos is None else frozenset({eos})


def _add_logprob_outputs(out: LogprobOutputs, req: Req, start: int) -> None:
    """The request's logprobs new since output token `start` (and its prompt's, once)."""
    top = req.return_logprob and req.top_logprobs_num > 0
    out.output_token_logprobs.append(req.output_token_logprobs[start:] if req.return_logprob else None)
    out.output_top_logprobs_val.append(req.output_top_logprobs_val[start:] if top else None)
    out.output_top_logprobs_idx.append(req.output_top_logprobs_idx[start:] if top else None)
    send_input = req.return_logprob and req.input_token_logprobs is not None and not req.input_logprobs_sent
    if send_input:
        req.input_logprobs_sent = True
    out.input_token_logprobs_val.append(req.input_token_logprobs if send_input else None)
    out.input_token_logprobs_idx.append(req.origin_input_ids[req.logprob_start_len :] if send_input else None)
    out.input_top_logprobs_val.append(req.input_top_logprobs_val if send_input and top else None)
    out.input_top_logprobs_idx.append(req.input_top_logprobs_idx if send_input and top else None)


def _queue_time(req: Req) -> float | None:
    """Seconds from arrival to the first prefill batch (None if it never got one)."""
    t = req.time_stats
    return t.forward_entry_time - t.wait_queue_entry_time if t.forward_entry_time else None


@dataclass
class HostResults:
    """A batch's sampled tokens on the host; the logprobs only when the batch asked for them
    (per row, or per prompt-logprob row for the input ones)."""

    next_ids: list[int]
    logprobs: list[float] | None
    invalid_rows: frozenset[int]  # rows whose logits had nothing to sample
    top_val: list[list[float]] | None = None
    top_idx: list[list[int]] | None = None
    input_logprobs: list[float] | None = None
    input_top_val: list[list[float]] | None = None
    input_top_idx: list[list[int]] | None = None


# GenerationBatchResult's fields copied to the host when present.
_OPTIONAL_RESULTS = (
    "next_token_logprobs",
    "invalid_rows",
    "next_token_top_logprobs_val",
    "next_token_top_logprobs_idx",
    "input_token_logprobs",
    "input_top_logprobs_val",
    "input_top_logprobs_idx",
)


@dataclass
class OverlapResult:
    """A launched batch's result: filled on the forward stream; read after `copy_done`."""

    next_token_ids: torch.Tensor | None = None
    next_token_logprobs: torch.Tensor | None = None
    invalid_rows: torch.Tensor | None = None
    next_token_top_logprobs_val: torch.Tensor | None = None
    next_token_top_logprobs_idx: torch.Tensor | None = None
    input_token_logprobs: torch.Tensor | None = None
    input_top_logprobs_val: torch.Tensor | None = None
    input_top_logprobs_idx: torch.Tensor | None = None
    copy_done: Any = None
    # A batch with a grammar, until its sample is launched: (the batch, its ModelWorkerBatch),
    # and the forward's result, whose delay_sample_func samples it.
    delayed_sample: tuple[ScheduleBatch, Any] | None = None
    forward_out: Any = None


def _tolist(t: torch.Tensor | None) -> list | None:
    return None if t is None else t.tolist()


def _offsets(counts: list[int] | None) -> list[int] | None:
    if counts is None:
        return None
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return offsets


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
