"""Request intake: the one receive point, validation, the waiting queue (with its limit and
priority eviction), aborts, and the requests answered at the end of a step (flush, state)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from radixengine.managers.io_struct import (
    AbortReq,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    TokenizedGenerateReqInput,
)
from radixengine.managers.schedule_batch import Req
from radixengine.managers.schedule_policy import lowest_priority_value, priority_sign

if TYPE_CHECKING:
    from radixengine.managers.scheduler import Scheduler

logger = logging.getLogger("radixengine.managers.scheduler")


def validate_request(req: Req, vocab_size: int, max_req_input_len: int, max_req_len: int) -> str | None:
    """The reason a request cannot run, or None."""
    try:
        req.sampling_params.verify(vocab_size)
    except ValueError as e:
        return f"Invalid sampling parameters: {e}"
    ids = req.origin_input_ids
    n = len(ids)
    if n == 0:
        return "The prompt is empty: at least one input token is required."
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        return f"Input token id {bad} is outside the vocabulary [0, {vocab_size})."
    if n >= max_req_input_len:
        return (
            f"The input ({n} tokens) is longer than the model's context length allows "
            f"(at most {max_req_input_len - 1} input tokens)."
        )
    max_new = req.sampling_params.max_new_tokens
    if req.return_logprob and not 0 <= req.logprob_start_len <= n:
        return f"logprob_start_len {req.logprob_start_len} must be -1 or in [0, {n}] (the input's length)."
    if n + max_new > max_req_len:
        return (
            f"Requested token count exceeds the model's maximum context length of "
            f"{max_req_len} tokens: {n} input tokens + max_new_tokens {max_new} = {n + max_new}. "
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
    )


class SchedulerIntakeMixin:
    def recv_requests(self: Scheduler, block: bool = False) -> list[object]:
        """The scheduler's one receive point."""
        return self.io.recv(block)

    def process_input_requests(self: Scheduler, msgs: list[object]) -> None:
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

    def handle_generate_request(self: Scheduler, recv: TokenizedGenerateReqInput) -> None:
        req = req_from_input(recv)
        try:
            error = recv.error or self._init_request(req)
        except Exception as e:  # one bad request fails alone; the scheduler keeps serving
            logger.exception("scheduler: cannot initialise request %r", req.rid)
            error = f"Invalid request: {type(e).__name__}: {e}"
        if error is None and req.sampling_params.grammar_key is not None:
            error = self.grammar_manager.process_req_with_grammar(req)
            if error is not None:
                self._finish_at_once(req, error, 400, param=req.sampling_params.grammar_key[0])
                return
            if isinstance(req.grammar, Future):
                return  # in the grammar queue until its grammar compiles
        if error is not None:
            self._finish_at_once(req, error, 400)
            return
        self._add_request_to_queue(req)

    def _init_request(self: Scheduler, req: Req) -> str | None:
        """The request's scheduler-side state (stop-string window, default priority), or why it
        cannot run."""
        req.init_stop_str_window(self.tokenizer)
        if self.enable_priority_scheduling and req.priority is None:
            req.priority = lowest_priority_value(self.schedule_low_priority_values_first)
        return validate_request(req, self.vocab_size, self.max_req_input_len, self.max_req_len)

    def move_ready_grammar_requests(self: Scheduler) -> None:
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
                self._finish_at_once(req, error, 400, param=req.sampling_params.grammar_key[0])
            else:
                self._add_request_to_queue(req)

    def _finish_at_once(
        self: Scheduler, req: Req, message: str, status_code: int, param: str | None = None
    ) -> None:
        err_type = "ServiceUnavailableError" if status_code == 503 else "BadRequestError"
        req.abort(message, status_code, err_type, param)
        req.time_stats.finish_time = time.perf_counter()
        self._pending_outputs.append(req)

    def _priority_key(self: Scheduler, req: Req) -> tuple[int, float]:
        """Ascending = more important first; ties: earlier arrival first."""
        return req.priority * priority_sign(self.schedule_low_priority_values_first), (
            req.time_stats.wait_queue_entry_time
        )

    def _add_request_to_queue(self: Scheduler, req: Req) -> None:
        req.time_stats.wait_queue_entry_time = time.perf_counter()
        limit = self.max_queued_requests
        if limit is not None and len(self.waiting_queue) >= limit:
            if not self.enable_priority_scheduling:
                self._finish_at_once(req, "The request queue is full.", 503)
                return
            worst = max(self.waiting_queue, key=self._priority_key)
            if self._priority_key(req)[0] >= self._priority_key(worst)[0]:
                self._finish_at_once(req, "The request queue is full.", 503)
                return
            self.waiting_queue.remove(worst)
            self._finish_at_once(worst, "The request is aborted by a higher priority request.", 503)
        self.waiting_queue.append(req)

    def _requeue(self: Scheduler, reqs: list[Req]) -> None:
        """Retracted or preempted requests go back to the waiting queue (no queue limit)."""
        for req in reqs:
            if req.to_abort:
                req.check_finished(self.eos_token_ids)
                self._pending_outputs.append(req)
            else:
                self.waiting_queue.append(req)

    # Abort, flush ------------------------------------------------------------------------------

    def abort_request(self: Scheduler, rid: str) -> None:
        req = self.grammar_manager.abort_request(rid)
        if req is None:
            i = next((i for i, r in enumerate(self.waiting_queue) if r.rid == rid), None)
            req = None if i is None else self.waiting_queue.pop(i)
        if req is not None:
            req.to_abort = True
            req.check_finished(self.eos_token_ids)
            req.time_stats.finish_time = time.perf_counter()
            self._pending_outputs.append(req)
            return
        for req in self._active_reqs():
            if req.rid == rid and not req.finished():
                req.to_abort = True  # finished at its next result, which frees its KV

    def _active_reqs(self: Scheduler) -> list[Req]:
        reqs = list(self.running_batch.reqs)
        for batch in (self.last_batch, self.cur_batch):
            if batch is not None:
                reqs.extend(batch.reqs)
        if self.chunked_req is not None:
            reqs.append(self.chunked_req)
        return reqs

    def flush_cache(self: Scheduler) -> bool:
        return self._flush_cache()[0]

    def _flush_cache(self: Scheduler) -> tuple[bool, str]:
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

    def _answer_deferred_requests(self: Scheduler) -> None:
        msgs, self._deferred_requests = self._deferred_requests, []
        for msg in msgs:
            if isinstance(msg, FlushCacheReqInput):
                ok, message = self._flush_cache()
                self.io.send(FlushCacheReqOutput(success=ok, message=message))
            else:
                self.io.send(GetInternalStateReqOutput(state=self.get_internal_state()))
