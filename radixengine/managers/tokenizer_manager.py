"""TokenizerManager: the front end's side of the engine (main process, asyncio).

It takes one request at a time (the front ends normalise their calls first, see
`GenerateReqInput.normalize_batch_and_arguments`), has it tokenized and validated once
(request_validator), sends it to the scheduler process and yields the detokenized outputs as they
come back from the detokenizer process, gathered in the request's ReqState (req_state). A
watchdog polls the child processes: if one dies, every pending request fails at once with an
`EngineDeadError` naming it. With a `restarter` (the HTTP server) new children start and serve
the later requests (`SchedulerRestartError`, a 503, while they start); without one, or past its
limit, every later request fails too. Closing the manager (`aclose`, on shutdown) fails the
pending requests the same way."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from radixengine.managers.engine_processes import SchedulerRestarter
from radixengine.managers.generate_output import GenerateOutput
from radixengine.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    ClearHiCacheReqInput,
    ClearHiCacheReqOutput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    LoRAAdapterReqOutput,
    TokenizedGenerateReqInput,
)
from radixengine.managers.req_state import LogprobState, ReqState
from radixengine.managers.request_errors import (
    EngineDeadError,
    RequestError,
    SchedulerRestartError,
    abort_to_error,
    is_abort,
    is_requested_abort,
)
from radixengine.managers.request_logger import RequestLogger
from radixengine.managers.request_validator import RequestLimits, RequestValidator
from radixengine.managers.scheduler_exit import WATCHDOG_EXIT_CODE, describe_scheduler_exit
from radixengine.managers.served_model import ServedModel, load_chat_template, load_tokenizer
from radixengine.managers.tokenizer_lora import TokenizerLoRA

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL = 0.2
SHUTTING_DOWN_MESSAGE = "the server is shutting down"


async def collect(
    tm: TokenizerManager, obj: GenerateReqInput, keep_requested_abort: bool = False
) -> GenerateOutput:
    """The request's final output; a RequestError if it was refused or aborted (with
    `keep_requested_abort`, an abort someone asked for is the output, as SGLang's /generate has it)."""
    out = None
    async for chunk in tm.generate_request(obj):
        out = chunk
    if out is not None and keep_requested_abort and is_requested_abort(out):
        return out
    if out is None or is_abort(out):
        raise abort_to_error(out) if out is not None else RequestError("no output", 500)
    return out


class TokenizerManager:
    def __init__(self, server_args, port_args, scheduler_info: dict | None = None, tokenizer=None) -> None:
        self.server_args = server_args
        self.port_args = port_args
        self.scheduler_info = dict(scheduler_info or {})
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(server_args)
        if server_args.chat_template:
            self.tokenizer.chat_template = load_chat_template(server_args.chat_template)
        self.init_model_info(ServedModel.from_server_args(server_args))
        limits = RequestLimits.from_scheduler_info(self.scheduler_info, self.tokenizer)
        self.context_len: int | None = limits.context_len
        self.vocab_size: int = limits.vocab_size
        self.validator = RequestValidator(self.tokenizer, limits, server_args.grammar_backend)
        self.rid_to_state: dict[str, ReqState] = {}
        self.processes: list[tuple[str, Any]] = []  # (name, multiprocessing.Process) for the watchdog
        self.dead_error: str | None = None
        self.dead_error_type: type[EngineDeadError] = EngineDeadError
        self.restarter: SchedulerRestarter | None = None  # starts new children after a death
        self.scheduler_restarts = 0
        self.on_dead = None  # called with the message when a child process dies
        self.stopping = False
        self.metrics = None
        if server_args.enable_metrics:
            from radixengine.managers.metrics import TokenizerMetricsCollector

            self.metrics = TokenizerMetricsCollector(self.served_model_name)
        self.request_logger = RequestLogger(server_args.log_requests, server_args.log_requests_level)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._pending_replies: dict[type, deque] = {
            FlushCacheReqOutput: deque(),
            GetInternalStateReqOutput: deque(),
            ClearHiCacheReqOutput: deque(),
            LoRAAdapterReqOutput: deque(),
        }
        self.lora = TokenizerLoRA(server_args, self._request_reply, self.served_model_name)

    def init_model_info(self, served: ServedModel) -> None:
        """What the info routes report about the model (see ServedModel)."""
        self.model_path = served.model_path
        self.resolved_model_path = served.resolved_model_path
        self.hf_dir = served.hf_dir
        self.tokenizer_path = served.tokenizer_path
        self.served_model_name = served.served_model_name
        self.default_sampling_params = served.default_sampling_params

    # Start-up (in the loop that will serve the requests) ---------------------------------------

    def ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None:
            raise RuntimeError("the TokenizerManager is bound to another event loop")
        import zmq
        import zmq.asyncio

        self._loop = loop
        self.context = zmq.asyncio.Context(2)
        self.recv_from_detokenizer = self.context.socket(zmq.PULL)
        self.recv_from_detokenizer.bind(self.port_args.tokenizer_ipc_name)
        self.send_to_scheduler = self.context.socket(zmq.PUSH)
        self.send_to_scheduler.connect(self.port_args.scheduler_input_ipc_name)
        self._tasks = [loop.create_task(self.handle_loop()), loop.create_task(self.watchdog_loop())]

    async def aclose(self, message: str = "the engine was shut down") -> None:
        """Fail every pending request with `EngineDeadError(message)`, stop the loops and close
        the sockets (in the manager's event loop)."""
        self.stopping = True
        if self.dead_error is None:
            self.fail_pending(message)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._loop is not None:
            self.send_to_scheduler.close(linger=0)
            self.recv_from_detokenizer.close(linger=0)
            self.context.term()
            self._loop = None

    # Requests ----------------------------------------------------------------------------------

    async def generate_request(self, obj: GenerateReqInput) -> AsyncIterator[GenerateOutput]:
        """Yield the request's outputs: one per step when streaming, else the final one. Each
        output holds the text and output ids *so far* and `meta_info`; aborted requests end with
        `meta_info.finish_reason.type == "abort"` (see `is_abort`)."""
        self.ensure_started()
        self.check_alive()
        tokenized = self.tokenize_request(obj)
        self.request_logger.log_received(obj)
        state = ReqState(obj, tokenized.sampling_params, len(tokenized.input_ids))
        if obj.return_logprob:
            state.logprobs = LogprobState()
        self.rid_to_state[tokenized.rid] = state
        self.send_to_scheduler.send_pyobj(tokenized)
        if tokenized.lora_id is not None:
            self.lora.registry.acquire(tokenized.lora_id)
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                while state.outs:
                    out = state.outs.popleft()
                    if isinstance(out, Exception):
                        raise out
                    yield out
                    if out["meta_info"]["finish_reason"] is not None:
                        return
        finally:
            if not state.finished:
                self.abort_request(tokenized.rid)
            if tokenized.lora_id is not None:
                self.lora.registry.release(tokenized.lora_id)

    def abort_request(self, rid: str) -> None:
        """Abort a running request. Its state stays, marked aborted, until the scheduler's final
        output for it arrives (that output is dropped): until then the rid is taken, and a new
        request with the same rid is refused."""
        state = self.rid_to_state.get(rid)
        if state is None or state.finished or state.aborted:
            return
        state.aborted = True
        self.send_to_scheduler.send_pyobj(AbortReq(rid))

    def abort_for_client(self, rid: str = "", abort_all: bool = False) -> list[str]:
        """SGLang's /abort_request: end the request `rid` (or every one) for the client still
        waiting on it, which gets the abort as its answer (status 499). Returns the rids."""
        self.ensure_started()
        rids = [
            r for r, state in self.rid_to_state.items()
            if (abort_all or r == rid) and not state.finished and not state.aborted
        ]  # fmt: skip
        for r in rids:
            self.send_to_scheduler.send_pyobj(AbortReq(r))
        return rids

    async def flush_cache(self) -> FlushCacheReqOutput:
        return await self._request_reply(FlushCacheReqInput(), FlushCacheReqOutput)

    async def clear_hicache_storage(self) -> ClearHiCacheReqOutput:
        return await self._request_reply(ClearHiCacheReqInput(), ClearHiCacheReqOutput)

    async def get_internal_state(self) -> dict:
        reply = await self._request_reply(GetInternalStateReq(), GetInternalStateReqOutput)
        return reply.state

    async def _request_reply(self, msg: object, reply_type: type, timeout: float = 60.0):
        self.ensure_started()
        self.check_alive()
        future = self._loop.create_future()
        self._pending_replies[reply_type].append(future)
        self.send_to_scheduler.send_pyobj(msg)
        return await asyncio.wait_for(future, timeout)

    # Tokenization and validation ---------------------------------------------------------------

    def tokenize_request(self, obj: GenerateReqInput) -> TokenizedGenerateReqInput:
        rid = self.check_rid(obj.rid)
        tokenized = self.validator.tokenize_request(obj, rid)
        tokenized.lora_id = self.lora.resolve(obj.lora_path)
        obj.rid = rid
        return tokenized

    def apply_chat_template(self, messages: list[dict], *args, **kwargs) -> str:
        """RequestValidator.apply_chat_template."""
        return self.validator.apply_chat_template(messages, *args, **kwargs)

    def check_grammar(self, kind: str, text: str, param: str | None = None) -> None:
        self.validator.check_grammar(kind, text, param)

    def check_rid(self, rid: object) -> str:
        """The request's id: the given one (a string no running request has), or a new one. A
        request aborted by its client holds its rid until the scheduler has finished it."""
        if rid is None or rid == "":
            return uuid.uuid4().hex
        if not isinstance(rid, str):
            raise RequestError(f"rid must be a string, got {type(rid).__name__}", param="rid")
        if rid in self.rid_to_state:
            raise RequestError(
                f"duplicate request id {rid!r}: a request with this id is still running (or being aborted)",
                param="rid",
            )
        return rid

    # Outputs -----------------------------------------------------------------------------------

    async def handle_loop(self) -> None:
        while True:
            recv = await self.recv_from_detokenizer.recv_pyobj()
            if isinstance(recv, BatchStrOut):
                self.handle_batch_output(recv)
            elif type(recv) in self._pending_replies:
                queue = self._pending_replies[type(recv)]
                while queue:
                    future = queue.popleft()
                    if not future.done():
                        future.set_result(recv)
                        break
            else:
                logger.warning("unexpected message from the scheduler: %r", type(recv).__name__)

    def handle_batch_output(self, recv: BatchStrOut) -> None:
        now = time.perf_counter()
        for i, rid in enumerate(recv.rids):
            state = self.rid_to_state.get(rid)
            if state is None:
                continue  # failed already (the engine died or shut down)
            reason = recv.finished_reasons[i]
            self._add_output(state, recv, i, now)
            if state.aborted:  # its client left: the outputs only count in the metrics
                if reason is not None:  # the scheduler is done with it: the rid is free again
                    del self.rid_to_state[rid]
                    self._observe_finished(state, state.make_output(recv, i, now), now)
                continue
            if reason is None and not state.obj.stream:
                continue
            out = state.make_output(recv, i, now)
            state.outs.append(out)
            if reason is not None:
                state.finished = True
                del self.rid_to_state[rid]
                self._observe_finished(state, out, now)
                self.request_logger.log_finished(state.obj, out)
            state.event.set()

    def _observe_finished(self, state: ReqState, out: GenerateOutput, now: float) -> None:
        if self.metrics is not None and state.obj.log_metrics:
            self.metrics.observe_finished(out["meta_info"], state.created_time, now)

    def _add_output(self, state: ReqState, recv: BatchStrOut, i: int, now: float) -> None:
        num_new = state.add_output(recv, i, self.decode_tokens)
        self._record_tokens(state, num_new, now)
        if i < len(recv.queue_times):
            self._record_queue_time(state, recv.queue_times[i])

    def decode_tokens(self, ids: list[int]) -> list[str]:
        """Each token's own text (the logprobs' `text`)."""
        return self.tokenizer.batch_decode([[t] for t in ids])

    def _record_tokens(self, state: ReqState, num_new: int, now: float) -> None:
        if num_new <= 0:
            return
        if self.metrics is not None and state.obj.log_metrics:
            self.metrics.observe_tokens(state, num_new, now)
        if state.first_token_time is None:
            state.first_token_time = now
        state.last_token_time = now

    def _record_queue_time(self, state: ReqState, queue_time: float | None) -> None:
        if queue_time is None or state.queue_time_seen:
            return
        state.queue_time_seen = True
        if self.metrics is not None and state.obj.log_metrics:
            self.metrics.observe_queue_time(queue_time)

    # Liveness ----------------------------------------------------------------------------------

    def check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error_type(self.dead_error)

    @property
    def restarting(self) -> bool:
        return self.dead_error_type is SchedulerRestartError

    async def watchdog_loop(self) -> None:
        while self.dead_error is None:
            await asyncio.sleep(WATCHDOG_INTERVAL)
            dead = next(((name, proc) for name, proc in self.processes if not proc.is_alive()), None)
            if dead is not None and self.stopping:  # ended with the server (one signal to the group)
                logger.info("the %s process has ended: the server is shutting down", dead[0])
                self.fail_pending(SHUTTING_DOWN_MESSAGE)
            elif dead is not None and self.restarter is not None and self.restarter.may_restart():
                await self.restart_children(self._death_message(*dead))
            elif dead is not None:
                limit = f"; {self.restarter.limit_message()}" if self.restarter is not None else ""
                self.fail_all(self._death_message(*dead) + limit)

    async def restart_children(self, death: str) -> None:
        """Fail the pending requests, start new children (refusing requests meanwhile), then
        serve again; if they cannot start, the engine is dead."""
        logger.error("%s; failing its requests and starting a new scheduler", death)
        self.fail_pending(f"{death}; a new scheduler is starting", SchedulerRestartError)
        try:
            self.processes, port_args = await asyncio.to_thread(self.restarter.restart, self.processes)
        except Exception as e:
            self.dead_error_type = EngineDeadError
            self.fail_all(f"{death}; the new scheduler failed to start: {e}")
            return
        if self.stopping:
            return
        import zmq

        self.send_to_scheduler.close(linger=0)
        self.send_to_scheduler = self.context.socket(zmq.PUSH)
        self.send_to_scheduler.connect(port_args.scheduler_input_ipc_name)
        self.port_args = port_args
        self.scheduler_restarts += 1
        if self.metrics is not None:
            self.metrics.scheduler_restarts.labels(**self.metrics.labels).inc()
        self.dead_error, self.dead_error_type = None, EngineDeadError
        logger.info("the new scheduler is ready (restart %d)", self.scheduler_restarts)

    def _death_message(self, name: str, proc) -> str:
        if name == "scheduler" and proc.exitcode == WATCHDOG_EXIT_CODE:
            timeout = self.server_args.watchdog_timeout
            return (
                f"the scheduler process (pid {proc.pid}) was ended by its watchdog: a forward batch ran "
                f"longer than --watchdog-timeout {timeout:g} s"
            )
        if name == "scheduler" and (rank_death := describe_scheduler_exit(proc.exitcode, proc.pid)):
            return rank_death
        return f"the {name} process (pid {proc.pid}) died unexpectedly (exit code {proc.exitcode})"

    def fail_all(self, message: str) -> None:
        logger.error("%s; failing every request", message)
        self.fail_pending(message)
        if self.on_dead is not None:
            self.on_dead(message)

    def fail_pending(self, message: str, error_type: type[EngineDeadError] = EngineDeadError) -> None:
        """End every pending request and control call with `error_type(message)`, and every
        later one too until a restart (a child process died, or the engine is shutting down)."""
        self.dead_error, self.dead_error_type = message, error_type
        for state in self.rid_to_state.values():
            state.outs.append(error_type(message))
            state.finished = True
            state.event.set()
        self.rid_to_state.clear()
        for queue in self._pending_replies.values():
            while queue:
                future = queue.popleft()
                if not future.done():
                    future.set_exception(error_type(message))
