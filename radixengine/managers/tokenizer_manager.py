"""TokenizerManager: the front end's side of the engine (main process, asyncio).

It tokenizes a request (text, chat messages through the tokenizer's chat template, or input ids),
validates it, sends it to the scheduler process and yields the detokenized outputs as they come
back from the detokenizer process. A watchdog polls the child processes: if one dies, every
pending request and every later one fails at once with an `EngineDeadError` naming it; closing
the manager (`aclose`, on shutdown) fails the pending requests the same way."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from radixengine.constrained.base_grammar_backend import validate_grammar
from radixengine.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    TokenizedGenerateReqInput,
)
from radixengine.managers.request_logger import RequestLogger
from radixengine.managers.scheduler_process import WATCHDOG_EXIT_CODE
from radixengine.managers.scheduler_ranks import describe_scheduler_exit
from radixengine.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL = 0.2


class RequestError(Exception):
    """A request the engine refused or aborted (bad input, full queue, ...), with its HTTP status."""

    def __init__(
        self, message: str, status_code: int = 400, param: str | None = None, err_type: str | None = None
    ):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.err_type = err_type or ("BadRequestError" if status_code < 500 else "ServiceUnavailableError")


class EngineDeadError(RuntimeError):
    """A child process of the engine died; the engine cannot serve any more requests."""


def load_tokenizer(server_args):
    from radixengine.model_loader import get_tokenizer

    return get_tokenizer(server_args.model_path, server_args.revision, server_args.tokenizer_path)


def is_abort(out: dict) -> bool:
    reason = out["meta_info"].get("finish_reason")
    return bool(reason) and reason.get("type") == "abort"


def abort_to_error(out: dict) -> RequestError:
    reason = out["meta_info"]["finish_reason"]
    return RequestError(
        reason.get("message", "request aborted"),
        reason.get("status_code", 400),
        err_type=reason.get("err_type"),
    )


@dataclass
class LogprobState:
    """A request's logprobs in SGLang's meta_info shapes: `(logprob, token_id, text or None)` per
    token, and per position a list of those for the most likely tokens (None where there is no
    distribution: the first prompt token)."""

    input_token_logprobs: list[tuple] = field(default_factory=list)
    output_token_logprobs: list[tuple] = field(default_factory=list)
    input_top_logprobs: list[list[tuple] | None] = field(default_factory=list)
    output_top_logprobs: list[list[tuple] | None] = field(default_factory=list)

    def meta_info(self, top_logprobs_num: int, copy: bool) -> dict:
        c = list if copy else (lambda x: x)
        meta = {
            "input_token_logprobs": c(self.input_token_logprobs),
            "output_token_logprobs": c(self.output_token_logprobs),
            "output_token_logprobs_length": len(self.output_token_logprobs),
        }
        if top_logprobs_num > 0:
            meta["input_top_logprobs"] = c(self.input_top_logprobs)
            meta["output_top_logprobs"] = c(self.output_top_logprobs)
        return meta


@dataclass
class ReqState:
    obj: GenerateReqInput
    sampling_params: SamplingParams
    prompt_tokens: int
    event: asyncio.Event = field(default_factory=asyncio.Event)
    outs: deque = field(default_factory=deque)
    finished: bool = False
    # Aborted by its caller: the state (and so the rid) is kept until the scheduler's final output
    # for it arrives, so that a new request with the same rid cannot receive the old one's outputs.
    aborted: bool = False
    # The outputs so far (the detokenizer sends what is new each step); the text only when streaming.
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: LogprobState | None = None  # with return_logprob
    created_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None
    queue_time_seen: bool = False


class TokenizerManager:
    def __init__(self, server_args, port_args, scheduler_info: dict | None = None, tokenizer=None) -> None:
        self.server_args = server_args
        self.port_args = port_args
        self.scheduler_info = dict(scheduler_info or {})
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(server_args)
        if server_args.chat_template:
            self.tokenizer.chat_template = load_chat_template(server_args.chat_template)
        self.model_path = server_args.model_path or _default_model_path()  # as given
        self.resolved_model_path = _located(self.model_path, server_args.revision)  # its folder or file
        self.hf_dir = _hf_dir(self.resolved_model_path)  # config.json's folder (a GGUF's converted cache)
        self.tokenizer_path = server_args.tokenizer_path or self.hf_dir
        self.served_model_name = server_args.served_model_name or _model_name(server_args.model_path)
        self.default_sampling_params = (
            model_sampling_defaults(self.hf_dir) if server_args.sampling_defaults == "model" else {}
        )
        self.context_len: int | None = self.scheduler_info.get("context_len")
        self.max_req_input_len: int | None = self.scheduler_info.get("max_req_input_len")
        self.max_req_len: int | None = self.scheduler_info.get("max_req_len") or self.context_len
        self.vocab_size: int = self.scheduler_info.get("vocab_size") or len(self.tokenizer)
        self.rid_to_state: dict[str, ReqState] = {}
        self.processes: list[tuple[str, Any]] = []  # (name, multiprocessing.Process) for the watchdog
        self.dead_error: str | None = None
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
        }

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

    async def generate_request(self, obj: GenerateReqInput) -> AsyncIterator[dict]:
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
        input_text, input_ids, param = self.tokenize_prompt(obj)
        sampling_params = self.make_sampling_params(obj.sampling_params, len(input_ids))
        self.validate_input_ids(input_ids, sampling_params, param)
        if obj.priority is not None and (not isinstance(obj.priority, int) or isinstance(obj.priority, bool)):
            raise RequestError(f"priority must be an integer, got {obj.priority!r}", param="priority")
        check_logprob_params(obj, len(input_ids), self.vocab_size)
        obj.rid = rid
        return TokenizedGenerateReqInput(
            rid=rid,
            input_text=input_text,
            input_ids=input_ids,
            sampling_params=sampling_params,
            stream=obj.stream,
            return_logprob=obj.return_logprob,
            top_logprobs_num=obj.top_logprobs_num if obj.return_logprob else 0,
            logprob_start_len=obj.logprob_start_len if obj.return_logprob else -1,
            priority=obj.priority,
        )

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

    def make_sampling_params(self, params: dict | SamplingParams | None, prompt_len: int) -> SamplingParams:
        """`max_new_tokens: None` means up to the end of the context (OpenAI's chat default); any
        other None is the field's default."""
        if isinstance(params, SamplingParams):
            return self._with_vocab_checked(params)
        if params is not None and not isinstance(params, dict):
            raise RequestError("sampling_params must be an object", param="sampling_params")
        if params is not None:
            params = {k: v for k, v in params.items() if v is not None or k == "max_new_tokens"}
        if params is not None and "max_new_tokens" in params and params["max_new_tokens"] is None:
            room = (self.max_req_len or prompt_len + 128) - prompt_len
            params = dict(params, max_new_tokens=max(room, 1))
        try:
            sampling_params = SamplingParams.from_dict(params)
        except (ValueError, TypeError) as e:
            raise RequestError(str(e), param=_param_of(str(e), params)) from None
        if sampling_params.n != 1:
            raise RequestError(
                "n > 1 is expanded by the front end; the tokenizer manager takes n == 1", param="n"
            )
        return self._with_vocab_checked(sampling_params)

    def _with_vocab_checked(self, sampling_params: SamplingParams) -> SamplingParams:
        """The checks that need the vocabulary (logit_bias's token ids) or the grammar backend."""
        try:
            sampling_params.verify(self.vocab_size)
        except ValueError as e:
            raise RequestError(str(e), param="logit_bias") from None
        if sampling_params.grammar_key is not None:
            self.check_grammar(*sampling_params.grammar_key)
        return sampling_params

    def check_grammar(self, kind: str, text: str, param: str | None = None) -> None:
        """A 400 naming the problem for a grammar the backend cannot use (checked here, before
        the scheduler compiles it)."""
        error = _grammar_error(self.server_args.grammar_backend, kind, text)
        if error is not None:
            raise RequestError(error, param=param or kind)

    def tokenize_prompt(self, obj: GenerateReqInput) -> tuple[str | None, list[int], str]:
        given = [name for name in ("text", "input_ids", "messages") if getattr(obj, name) is not None]
        if len(given) != 1:
            raise RequestError("give exactly one of text, input_ids or messages", param="text")
        if obj.messages is not None:
            text = self.apply_chat_template(
                obj.messages, obj.chat_template_kwargs, obj.continue_final_message, obj.tools
            )
            return text, self.tokenizer.encode(text, add_special_tokens=False), "messages"
        if obj.text is not None:
            if not isinstance(obj.text, str):
                raise RequestError("text must be a string", param="text")
            return obj.text, self.tokenizer.encode(obj.text), "text"
        ids = obj.input_ids
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError("input_ids must be a list of integers", param="input_ids")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(
                f"input_ids must be in [0, {self.vocab_size}); got {bad[0]}", param="input_ids"
            )
        return None, list(ids), "input_ids"

    def apply_chat_template(
        self,
        messages: list[dict],
        kwargs: dict | None = None,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
    ) -> str:
        """The conversation rendered by the chat template; `kwargs` go to the template (e.g.
        Qwen3's enable_thinking), and `tools` (OpenAI function definitions; a template without
        tool support ignores them); `continue_final_message` leaves the last (assistant) message
        open for the model to continue instead of starting a new turn."""
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(f"messages[{i}] must be an object with a role", param="messages")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise RequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
        if continue_final_message and messages[-1]["role"] != "assistant":
            raise RequestError(
                "continue_final_message needs an assistant message last", param="continue_final_message"
            )
        options = dict(kwargs or {})
        options.update(add_generation_prompt=not continue_final_message, tokenize=False)
        if continue_final_message:
            options["continue_final_message"] = True
        if tools:
            options["tools"] = tools
        try:
            return self.tokenizer.apply_chat_template(messages, **options)
        except Exception as e:  # a template that rejects the conversation
            raise RequestError(f"cannot apply the chat template: {e}", param="messages") from None

    def validate_input_ids(self, input_ids: list[int], sampling_params: SamplingParams, param: str) -> None:
        n = len(input_ids)
        if n == 0:
            raise RequestError("the prompt is empty", param=param)
        if self.max_req_input_len is not None and n >= self.max_req_input_len:
            raise RequestError(
                f"the prompt is too long: {n} tokens, the maximum is {self.max_req_input_len - 1}",
                param=param,
            )
        if self.max_req_len is not None and n + sampling_params.max_new_tokens > self.max_req_len:
            raise RequestError(
                f"the prompt ({n} tokens) plus max_new_tokens ({sampling_params.max_new_tokens}) exceeds "
                f"the {self.max_req_len} tokens a request may have (context length {self.context_len})",
                param="max_new_tokens" if n < self.max_req_len else param,
            )

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
            if state.aborted:
                if reason is not None:  # the scheduler is done with it: the rid is free again
                    del self.rid_to_state[rid]
                continue
            self._add_output(state, recv, i, now)
            if reason is None and not state.obj.stream:
                continue
            out = self._make_output(state, recv, i, now)
            state.outs.append(out)
            if reason is not None:
                state.finished = True
                del self.rid_to_state[rid]
                if self.metrics is not None and state.obj.log_metrics:
                    self.metrics.observe_finished(out["meta_info"], state.created_time, now)
                self.request_logger.log_finished(state.obj, out)
            state.event.set()

    def _add_output(self, state: ReqState, recv: BatchStrOut, i: int, now: float) -> None:
        """Append the i-th request's new ids, logprobs and (streaming) text to its state."""
        new_ids = recv.output_ids[i]
        state.output_ids.extend(new_ids)
        if state.logprobs is not None and recv.output_token_logprobs:
            self._add_logprobs(state, recv, i, new_ids)
        if recv.finished_reasons[i] is not None:
            state.text = recv.output_strs[i]  # the whole final text
        elif state.obj.stream:
            state.text += recv.output_strs[i]
        self._record_tokens(state, len(new_ids), now)
        if i < len(recv.queue_times):
            self._record_queue_time(state, recv.queue_times[i])

    def _make_output(self, state: ReqState, recv: BatchStrOut, i: int, now: float) -> dict:
        """The request's output so far (copies while it streams: later steps extend the state)."""
        reason = recv.finished_reasons[i]
        meta = {
            "id": recv.rids[i],
            "prompt_tokens": recv.prompt_tokens[i],
            "completion_tokens": len(state.output_ids),
            "cached_tokens": recv.cached_tokens[i],
            "finish_reason": reason,
            "e2e_latency": now - state.created_time,
        }
        finished = reason is not None
        if state.logprobs is not None:
            meta.update(state.logprobs.meta_info(state.obj.top_logprobs_num, copy=not finished))
        text = state.text if finished else self._visible_text(state.text, state)
        ids = state.output_ids if finished else list(state.output_ids)
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def _add_logprobs(self, state: ReqState, recv: BatchStrOut, i: int, new_ids: list[int]) -> None:
        """SGLang's convert_logprob_style: the message's new logprobs, as meta_info triples."""
        lp, text = state.logprobs, state.obj.return_text_in_logprobs
        if recv.input_token_logprobs_val[i] is not None:
            lp.input_token_logprobs += self._triples(
                recv.input_token_logprobs_val[i], recv.input_token_logprobs_idx[i], text
            )
            if recv.input_top_logprobs_val[i] is not None:
                lp.input_top_logprobs += self._top_triples(
                    recv.input_top_logprobs_val[i], recv.input_top_logprobs_idx[i], text
                )
        lp.output_token_logprobs += self._triples(recv.output_token_logprobs[i] or [], new_ids, text)
        if recv.output_top_logprobs_val[i] is not None:
            lp.output_top_logprobs += self._top_triples(
                recv.output_top_logprobs_val[i], recv.output_top_logprobs_idx[i], text
            )

    def _triples(self, values: list, ids: list[int], with_text: bool) -> list[tuple]:
        if not with_text:
            return [(v, t, None) for v, t in zip(values, ids)]
        texts = self.tokenizer.batch_decode([[t] for t in ids])
        return list(zip(values, ids, texts))

    def _top_triples(self, values: list, ids: list, with_text: bool) -> list[list[tuple] | None]:
        return [None if v is None else self._triples(v, t, with_text) for v, t in zip(values, ids)]

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

    @staticmethod
    def _visible_text(text: str, state: ReqState) -> str:
        """While streaming, hold back a tail that may turn out to be the start of a stop string."""
        params = state.sampling_params
        if not params.stop_strs or params.no_stop_trim:
            return text
        for stop in params.stop_strs:
            pos = text.find(stop)
            if pos != -1:
                text = text[:pos]
        hold = 0
        for stop in params.stop_strs:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return text[: len(text) - hold]

    # Liveness ----------------------------------------------------------------------------------

    def check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)

    async def watchdog_loop(self) -> None:
        while self.dead_error is None:
            await asyncio.sleep(WATCHDOG_INTERVAL)
            if self.stopping:
                return
            for name, proc in self.processes:
                if not proc.is_alive():
                    self.fail_all(self._death_message(name, proc))
                    break

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

    def fail_pending(self, message: str) -> None:
        """End every pending request and control call with `EngineDeadError(message)`, and every
        later one too (a child process died, or the engine is shutting down)."""
        self.dead_error = message
        for state in self.rid_to_state.values():
            state.outs.append(EngineDeadError(message))
            state.finished = True
            state.event.set()
        self.rid_to_state.clear()
        for queue in self._pending_replies.values():
            while queue:
                future = queue.popleft()
                if not future.done():
                    future.set_exception(EngineDeadError(message))


def check_logprob_params(obj: GenerateReqInput, input_len: int, vocab_size: int) -> None:
    """SGLang's logprob fields: `None` means the default; top_logprobs_num in [0, vocab size];
    logprob_start_len -1 (no prompt logprobs) or a position in the prompt (with return_logprob)."""
    for name, default in (("top_logprobs_num", 0), ("logprob_start_len", -1)):
        value = getattr(obj, name)
        if value is None:
            setattr(obj, name, default)
        elif not isinstance(value, int) or isinstance(value, bool):
            raise RequestError(f"{name} must be an integer, got {value!r}", param=name)
    for name in ("return_logprob", "return_text_in_logprobs"):
        if getattr(obj, name) is None:
            setattr(obj, name, False)
        elif not isinstance(getattr(obj, name), bool):
            raise RequestError(f"{name} must be a boolean", param=name)
    if not 0 <= obj.top_logprobs_num <= vocab_size:
        raise RequestError(
            f"top_logprobs_num must be in [0, {vocab_size}] (the vocabulary size), got {obj.top_logprobs_num}",
            param="top_logprobs_num",
        )
    if obj.return_logprob and not -1 <= obj.logprob_start_len <= input_len:
        raise RequestError(
            f"logprob_start_len must be -1 (no prompt logprobs) or in [0, {input_len}] (the number of "
            f"input tokens), got {obj.logprob_start_len}",
            param="logprob_start_len",
        )


def load_chat_template(value: str) -> str:
    """`--chat-template`: a file holding a Jinja template, or the template itself."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(hf_dir: str | None) -> dict:
    """The sampling fields the model's generation_config.json sets (SGLang's
    `--sampling-defaults model`); {} when it has none."""
    path = os.path.join(hf_dir, "generation_config.json") if hf_dir else None
    if path is None or not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    defaults = {k: config[k] for k in SAMPLING_DEFAULT_FIELDS if config.get(k) is not None}
    if defaults.get("top_k") == 0:  # transformers' "no top-k"
        defaults["top_k"] = -1
    return defaults


def _default_model_path() -> str | None:
    from radixengine.model_loader import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:
        return None


def _located(model_path: str | None, revision: str | None) -> str | None:
    """The folder or .gguf file the model is read from (a repo id's cached snapshot), None if
    there is none."""
    from radixengine.model_loader import locate_model

    try:
        return locate_model(model_path, revision) if model_path else None
    except (FileNotFoundError, ValueError, OSError):
        return None


def _hf_dir(model_path: str | None) -> str | None:
    """The HF folder of the model (a GGUF's converted cache), None if there is none."""
    from radixengine.model_loader import resolve_model_path

    try:
        return resolve_model_path(model_path) if model_path else None
    except (FileNotFoundError, ValueError, OSError):
        return None


def _model_name(model_path: str | None) -> str:
    if not model_path:
        return "SmolLM2-135M-Instruct"
    return model_path.rstrip("/")


@functools.lru_cache(maxsize=256)
def _grammar_error(backend: str, kind: str, text: str) -> str | None:
    return validate_grammar(backend, kind, text)


def _param_of(message: str, params: dict | None) -> str:
    for name in params or {}:
        if message.startswith(name) or f" {name}" in message or f"{name} " in message:
            return name
    return "sampling_params"
