"""Request intake: the one receive point, validation, the waiting queue (with its limit and
priority eviction), aborts, and the control messages answered at the end of a step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from radixengine.managers.grammar_manager import GrammarManager
from radixengine.managers.io_struct import (
    AbortReq,
    ClearHiCacheReqInput,
    ClearHiCacheReqOutput,
    FlushCacheReqInput,
    GetInternalStateReq,
    LoadLoRAAdapterReqInput,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReqInput,
)
from radixengine.managers.req import Tokenizer
from radixengine.managers.schedule_batch import Req
from radixengine.managers.schedule_policy import lowest_priority_value, priority_sign
from radixengine.managers.scheduler_components.lora_adapters import LoRAAdapters
from radixengine.managers.scheduler_components.output_streamer import OutputStreamer
from radixengine.mem_cache.base_prefix_cache import BasePrefixCache

logger = logging.getLogger("radixengine.managers.scheduler")

ControlMessage = FlushCacheReqInput | GetInternalStateReq


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_req_input_len: int
    max_req_len: int


@dataclass(frozen=True)
class QueueConfig:
    enable_priority_scheduling: bool
    schedule_low_priority_values_first: bool
    max_queued_requests: int | None

    @classmethod
    def of(cls, args: QueueArgs) -> QueueConfig:
        return cls(
            args.enable_priority_scheduling, args.schedule_low_priority_values_first, args.max_queued_requests
        )


class QueueArgs(Protocol):
    enable_priority_scheduling: bool
    schedule_low_priority_values_first: bool
    max_queued_requests: int | None


def validate_request(req: Req, limits: RequestLimits) -> str | None:
    """The reason a request cannot run, or None."""
    try:
        req.sampling_params.verify(limits.vocab_size)
    except ValueError as e:
        return f"Invalid sampling parameters: {e}"
    ids = req.origin_input_ids
    n = len(ids)
    if n == 0:
        return "The prompt is empty: at least one input token is required."
    if min(ids) < 0 or max(ids) >= limits.vocab_size:
        bad = next(t for t in ids if not 0 <= t < limits.vocab_size)
        return f"Input token id {bad} is outside the vocabulary [0, {limits.vocab_size})."
    if n >= limits.max_req_input_len:
        return (
            f"The input ({n} tokens) is longer than the model's context length allows "
            f"(at most {limits.max_req_input_len - 1} input tokens)."
        )
    max_new = req.sampling_params.max_new_tokens
    if req.return_logprob and not 0 <= req.logprob_start_len <= n:
        return f"logprob_start_len {req.logprob_start_len} must be -1 or in [0, {n}] (the input's length)."
    if n + max_new > limits.max_req_len:
        return (
            f"Requested token count exceeds the model's maximum context length of "
            f"{limits.max_req_len} tokens: {n} input tokens + max_new_tokens {max_new} = {n + max_new}. "
            f"Reduce the prompt or max_new_tokens."
        )
    return None


def req_from_input(recv: TokenizedGenerateReqInput) -> Req:
    return Req(
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
        interactive=recv.interactive,
        lora_id=recv.lora_id,
    )


class RequestIntake:
    def __init__(
        self,
        limits: RequestLimits,
        config: QueueConfig,
        grammar_manager: GrammarManager,
        tokenizer: Tokenizer | None,
        eos_token_ids: frozenset[int],
        streamer: OutputStreamer,
        active_reqs: Callable[[], list[Req]],
        tree_cache: BasePrefixCache | None = None,
        lora: LoRAAdapters | None = None,
    ) -> None:
        self.limits = limits
        self.lora = lora if lora is not None else LoRAAdapters(None, streamer.sink.send, 1)
        self.config = config
        self.grammar_manager = grammar_manager
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.streamer = streamer
        self.active_reqs = active_reqs  # requests admitted and not yet released
        # As a request enters the waiting queue the hierarchical cache starts reading its prefix
        # from storage (SGLang's _prefetch_kvcache); a request that leaves the queue without being
        # admitted (aborted, pushed out by a more important one) has that prefetch revoked.
        self.tree_cache = tree_cache
        if tree_cache is not None:  # an adapter's storage pages are keyed by its weights
            tree_cache.set_namespace_digests(self.lora.digest)
        # Admission orders it and takes from it in place (the list object never changes).
        self.waiting_queue: list[Req] = []
        # Answered at the end of the step, once its results are processed (under overlap a
        # finished request's last, one-step-late slot is freed only then).
        self.deferred: list[ControlMessage] = []

    def process_input_requests(self, msgs: list[object]) -> None:
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReqInput):
                self.handle_generate_request(msg)
            elif isinstance(msg, AbortReq):
                self.abort_request(msg.rid)
            elif isinstance(msg, ClearHiCacheReqInput):
                self.streamer.sink.send(self._clear_storage())
            elif isinstance(msg, (FlushCacheReqInput, GetInternalStateReq)):
                self.deferred.append(msg)
            elif isinstance(msg, (LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput)):
                self.lora.handle(msg)
            else:
                logger.error("scheduler: ignoring a message of unknown type %s", type(msg).__name__)

    def _clear_storage(self) -> ClearHiCacheReqOutput:
        """SGLang's /hicache/storage-backend/clear: delete the storage tier's pages."""
        if self.tree_cache is None:
            return ClearHiCacheReqOutput(False, "No storage tier.")
        return ClearHiCacheReqOutput(*self.tree_cache.clear_storage())

    def take_deferred(self) -> list[ControlMessage]:
        msgs, self.deferred = self.deferred, []
        return msgs

    def handle_generate_request(self, recv: TokenizedGenerateReqInput) -> None:
        req = req_from_input(recv)
        self.streamer.expect(req)
        try:
            error = recv.error or self._init_request(req)
        except Exception as e:  # one bad request fails alone; the scheduler keeps serving
            logger.exception("scheduler: cannot initialise request %r", req.rid)
            error = f"Invalid request: {type(e).__name__}: {e}"
        if error is None and req.sampling_params.grammar_key is not None:
            error = self.grammar_manager.process_req_with_grammar(req)
            if error is not None:
                self.finish_at_once(req, error, 400, param=req.sampling_params.grammar_key[0])
                return
            if isinstance(req.grammar, Future):
                return  # in the grammar queue until its grammar compiles
        if error is not None:
            self.finish_at_once(req, error, 400)
            return
        self._add_request_to_queue(req)

    def _init_request(self, req: Req) -> str | None:
        """The request's scheduler-side state (stop-string window, default priority; a batch line
        the lowest whatever it asked, so that it never preempts), or why it cannot run."""
        req.init_stop_str_window(self.tokenizer)
        if self.config.enable_priority_scheduling and (req.priority is None or not req.interactive):
            req.priority = lowest_priority_value(self.config.schedule_low_priority_values_first)
        return self.lora.request_error(req.lora_id) or validate_request(req, self.limits)

    def move_ready_grammar_requests(self, nothing_else_to_do: bool) -> None:
        """Requests whose grammar has compiled join the waiting queue (or fail with a 400). When
        nothing else can run, wait a little for a compile instead of spinning."""
        block = nothing_else_to_do and not self.waiting_queue
        for req, error in self.grammar_manager.get_ready_grammar_requests(block=block):
            if error is not None:
                self.finish_at_once(req, error, 400, param=req.sampling_params.grammar_key[0])
            else:
                self._add_request_to_queue(req)

    def finish_at_once(self, req: Req, message: str, status_code: int, param: str | None = None) -> None:
        err_type = "ServiceUnavailableError" if status_code == 503 else "BadRequestError"
        req.abort(message, status_code, err_type, param)
        req.time_stats.finish_time = time.perf_counter()
        self.streamer.add(req)

    def _priority_key(self, req: Req) -> tuple[int, float]:
        """Ascending = more important first; ties: earlier arrival first."""
        sign = priority_sign(self.config.schedule_low_priority_values_first)
        return req.priority * sign, req.time_stats.wait_queue_entry_time

    def _add_request_to_queue(self, req: Req) -> None:
        req.time_stats.wait_queue_entry_time = time.perf_counter()
        limit = self.config.max_queued_requests
        if limit is not None and len(self.waiting_queue) >= limit:
            if not self.config.enable_priority_scheduling:
                self.finish_at_once(req, "The request queue is full.", 503)
                return
            worst = max(self.waiting_queue, key=self._priority_key)
            if self._priority_key(req)[0] >= self._priority_key(worst)[0]:
                self.finish_at_once(req, "The request queue is full.", 503)
                return
            self.waiting_queue.remove(worst)
            self._dropped(worst)
            self.finish_at_once(worst, "The request is aborted by a higher priority request.", 503)
        self.waiting_queue.append(req)
        self._queued(req)

    def _queued(self, req: Req) -> None:
        if self.tree_cache is not None:
            self.tree_cache.prefetch_from_storage(req.rid, req.origin_input_ids, req.extra_key)

    def _dropped(self, req: Req) -> None:
        if self.tree_cache is not None:
            self.tree_cache.release_prefetch(req.rid)

    def remove_admitted(self, reqs: list[Req]) -> None:
        admitted = {id(r) for r in reqs}
        self.waiting_queue[:] = [r for r in self.waiting_queue if id(r) not in admitted]

    def requeue(self, reqs: list[Req]) -> None:
        """Retracted or preempted requests go back to the waiting queue (no queue limit)."""
        for req in reqs:
            if req.to_abort:
                req.check_finished(self.eos_token_ids)
                self.streamer.add(req)
            else:
                self.waiting_queue.append(req)
                self._queued(req)

    def abort_request(self, rid: str) -> None:
        req = self.grammar_manager.abort_request(rid)
        if req is None:
            i = next((i for i, r in enumerate(self.waiting_queue) if r.rid == rid), None)
            req = None if i is None else self.waiting_queue.pop(i)
            if req is not None:
                self._dropped(req)
        if req is not None:
            req.to_abort = True
            req.check_finished(self.eos_token_ids)
            req.time_stats.finish_time = time.perf_counter()
            self.streamer.add(req)
            return
        for req in self.active_reqs():
            if req.rid == rid and not req.finished():
                req.to_abort = True  # finished at its next result, which frees its KV
