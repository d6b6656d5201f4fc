"""Engine: the offline / in-process API over the same processes the HTTP server uses.

    engine = Engine()                       # the bundled SmolLM2 model
    engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
    engine.shutdown()

The main process runs the TokenizerManager in an asyncio loop on a background thread; the
scheduler and the detokenizer run in child processes (spawned, talking over ZMQ ipc:// sockets in
a private temporary directory). Errors: a single-prompt call raises `RequestError` for a request
the engine refuses or aborts; in a batch call every result carries its own outcome, and a failed
one has `"error"` (the message) and `meta_info.finish_reason == {"type": "abort", ...}` while the
others finish normally. If a child process dies, every call raises `EngineDeadError`; `shutdown()`
ends every call still in flight with `EngineDeadError` at once, and later calls raise RuntimeError."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Iterator

from radixengine.managers.engine_processes import SchedulerRestarter, start_children
from radixengine.managers.io_struct import GenerateReqInput, finish_abort
from radixengine.managers.request_errors import EngineDeadError, RequestError, abort_to_error, is_abort
from radixengine.managers.tokenizer_manager import TokenizerManager, collect
from radixengine.server_args import ServerArgs
from radixengine.utils import fault_injection
from radixengine.utils.network import PortArgs
from radixengine.utils.process import make_ipc_dir, remove_ipc_dir, terminate_processes

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineDeadError", "RequestError", "launch_subprocesses"]


def launch_subprocesses(server_args: ServerArgs, tokenizer=None, restart: bool = False) -> TokenizerManager:
    """Start the scheduler and detokenizer processes, wait until both are ready, and return the
    TokenizerManager wired to them (its `processes` are watched; `shutdown_subprocesses` ends them).
    With `restart` (the HTTP server) a dead scheduler is started again as
    --max-scheduler-restarts allows; without it (the offline Engine) a death ends the engine."""
    from radixengine.model_loader import resolve_model_path, resolve_tokenizer_path

    a = server_args
    fault_injection.check_env()
    resolve_model_path(a.model_path, a.revision)  # a GGUF is converted once, here, not by each process
    tokenizer_dir = resolve_tokenizer_path(a.model_path, a.tokenizer_path, a.revision)
    detokenizer_args = dataclasses.replace(server_args, tokenizer_path=tokenizer_dir)
    ipc_dir = make_ipc_dir()
    port_args = PortArgs.init_new(ipc_dir)
    try:
        procs, scheduler_info = start_children(server_args, detokenizer_args, port_args)
    except BaseException:
        remove_ipc_dir(ipc_dir)
        raise
    manager = TokenizerManager(server_args, port_args, scheduler_info, tokenizer)
    manager.processes = procs
    manager.ipc_dir = ipc_dir
    if restart and server_args.max_scheduler_restarts > 0:
        manager.restarter = SchedulerRestarter(
            server_args, detokenizer_args, ipc_dir, port_args.tokenizer_ipc_name
        )
    return manager


def shutdown_subprocesses(manager: TokenizerManager) -> None:
    manager.stopping = True
    terminate_processes([proc for _, proc in manager.processes])
    remove_ipc_dir(getattr(manager, "ipc_dir", None))


SHUTDOWN_MESSAGE = "the engine was shut down"


class _Runtime:
    """What shutdown needs, kept apart from the Engine so that a finalizer can hold it: the
    manager, its event loop and thread, and every call submitted to that loop."""

    def __init__(self, manager: TokenizerManager, loop: asyncio.AbstractEventLoop, thread: threading.Thread):
        self.manager, self.loop, self.thread = manager, loop, thread
        self.lock = threading.Lock()
        self.closed = False
        self.calls: weakref.WeakSet[concurrent.futures.Future] = weakref.WeakSet()

    def submit(self, coro) -> concurrent.futures.Future:
        """Run `coro` in the manager's loop; refused once shutdown began."""
        with self.lock:
            if self.closed:
                coro.close()
                raise RuntimeError("the engine has been shut down")
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
            self.calls.add(future)
        return future

    def shutdown(self) -> None:
        """Every call still running ends with `EngineDeadError` at once; then the loop stops and
        the child processes are ended."""
        with self.lock:
            self.closed = True
        self.manager.stopping = True
        if self.loop.is_running() and threading.current_thread() is not self.thread:
            try:
                asyncio.run_coroutine_threadsafe(_close(self.manager), self.loop).result(10.0)
            except Exception as e:  # best effort: the processes are ended below anyway
                logger.warning("closing the tokenizer manager: %r", e)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5.0)
        for future in list(self.calls):  # any the loop did not get to run
            if not future.done():
                future.set_exception(EngineDeadError(SHUTDOWN_MESSAGE))
        shutdown_subprocesses(self.manager)


async def _close(manager: TokenizerManager) -> None:
    """Close the manager (its pending requests fail with EngineDeadError), then let every other
    task of this loop (the calls in flight) see its error and end."""
    await manager.aclose(SHUTDOWN_MESSAGE)
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=5.0)


class Engine:
    def __init__(
        self, model_path: str | None = None, server_args: ServerArgs | None = None, **kwargs
    ) -> None:
        """`Engine(model_path, **server_args)` (ServerArgs' fields; an unknown one is a TypeError),
        or `Engine(server_args=ServerArgs(...))`."""
        if server_args is None:
            server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        elif model_path is not None or kwargs:
            raise TypeError("give either server_args or keyword arguments, not both")
        self.server_args = server_args
        logging.basicConfig(level=self.server_args.log_level.upper())
        self.tokenizer_manager = launch_subprocesses(self.server_args)
        self.tokenizer = self.tokenizer_manager.tokenizer
        self.loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self.loop.run_forever, name="radixengine-tokenizer", daemon=True)
        thread.start()
        self._runtime = _Runtime(self.tokenizer_manager, self.loop, thread)
        # Shut down on shutdown(), on garbage collection and at interpreter exit.
        self._finalizer = weakref.finalize(self, self._runtime.shutdown)
        self._run(_start(self.tokenizer_manager))

    # Generation --------------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        priority: int | list[int] | None = None,
        routing_key: str | list[str] | None = None,
        return_logprob: bool = False,
        rid: str | list[str] | None = None,
        messages: list[dict] | list[list[dict]] | None = None,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        lora_path: str | list[str | None] | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (a dict back; raises `RequestError` if refused) or a batch (a list
        of dicts in input order, one per prompt and per choice when n > 1; a refused one carries
        `"error"`). `stream=True` (one prompt) yields chunks with the new text and ids.
        The arguments are normalised as HTTP /generate's body is (per-prompt lists, `n`, rid
        suffixes: `GenerateReqInput.normalize_batch_and_arguments`); a bad shape raises
        `ArgumentError` (a RequestError naming the field, and a ValueError).
        Logprobs as SGLang's: `return_logprob` puts `output_token_logprobs` (`(logprob, id, text)`
        per output token; text only with `return_text_in_logprobs`) and `input_token_logprobs`
        (the prompt's from `logprob_start_len`, -1 for none; the first one's logprob is None) in
        `meta_info`; `top_logprobs_num` N adds `output_top_logprobs` / `input_top_logprobs`, the N
        most likely tokens at each position. `lora_path`: a loaded LoRA adapter's name (or one per
        prompt; None: the base model), as on /generate."""
        objs, single = _make_requests(locals())
        if stream:
            return self._stream_sync(objs[0])
        return self._run(self._generate_all(objs, single))

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        priority: int | list[int] | None = None,
        routing_key: str | list[str] | None = None,
        return_logprob: bool = False,
        rid: str | list[str] | None = None,
        messages: list[dict] | list[list[dict]] | None = None,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        lora_path: str | list[str | None] | None = None,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """`generate` for asyncio callers (any event loop); with stream=True, an async iterator."""
        objs, single = _make_requests(locals())
        if stream:
            return self._stream_async(objs[0])
        return await asyncio.wrap_future(self._runtime.submit(self._generate_all(objs, single)))

    async def async_openai(self, url: str, body: dict) -> dict:
        """The answer to an OpenAI `/v1/chat/completions` or `/v1/completions` body (not
        streamed) as the HTTP route gives it; a refused one raises `RequestError`."""
        from radixengine.entrypoints.openai_routes import answer_body

        coro = answer_body(self.tokenizer_manager, url, body)
        return await asyncio.wrap_future(self._runtime.submit(coro))

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: dict | list[dict] | None = None,
        **kwargs,
    ):
        """`generate` on chat messages (one conversation, or a list of them), rendered with the
        tokenizer's chat template."""
        return self.generate(sampling_params=sampling_params, messages=messages, **kwargs)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.tokenizer_manager.apply_chat_template(messages)

    # Control -----------------------------------------------------------------------------------

    def flush_cache(self) -> bool:
        return self._run(self.tokenizer_manager.flush_cache()).success

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict:
        """Load a LoRA adapter at run time (as POST /load_lora_adapter; docs/lora.md); a refused
        one raises `RequestError` with the reason. Returns the adapters loaded now (name → path)."""
        self._run(self.tokenizer_manager.lora.load(lora_name, lora_path, pinned))
        return self.tokenizer_manager.lora.loaded()

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """Unload it once its requests in flight finish (new ones naming it are refused at once)."""
        self._run(self.tokenizer_manager.lora.unload(lora_name))
        return self.tokenizer_manager.lora.loaded()

    def get_server_info(self) -> dict:
        state = self._run(self.tokenizer_manager.get_internal_state())
        info = dataclasses.asdict(self.server_args)
        info.update({k: v for k, v in self.tokenizer_manager.scheduler_info.items() if k != "status"})
        info.update(state)
        return info

    def shutdown(self) -> None:
        self._finalizer()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # Internals ---------------------------------------------------------------------------------

    def _run(self, coro):
        future = self._runtime.submit(coro)
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            raise

    async def _generate_all(self, objs: list[GenerateReqInput], single: bool):
        if single:
            return await collect(self.tokenizer_manager, objs[0])
        results = await asyncio.gather(*(_collect_or_error(self.tokenizer_manager, o) for o in objs))
        return list(results)

    def _stream_sync(self, obj: GenerateReqInput) -> Iterator[dict]:
        items: queue.Queue = queue.Queue()
        future = self._submit_pump(obj, items.put)
        delta = _StreamDelta()
        try:
            while (chunk := delta.take(items.get())) is not None:
                yield chunk
        finally:
            future.cancel()

    def _submit_pump(self, obj: GenerateReqInput, put) -> concurrent.futures.Future:
        """Start a stream's pump; if it cannot run (shutdown), its error still reaches the reader."""
        future = self._runtime.submit(_pump(self.tokenizer_manager, obj, put))

        def on_done(f: concurrent.futures.Future) -> None:
            if not f.cancelled() and f.exception() is not None:
                put(("error", f.exception()))

        future.add_done_callback(on_done)
        return future

    async def _stream_async(self, obj: GenerateReqInput) -> AsyncIterator[dict]:
        caller = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            caller.call_soon_threadsafe(items.put_nowait, item)

        future = self._submit_pump(obj, put)
        delta = _StreamDelta()
        try:
            while (chunk := delta.take(await items.get())) is not None:
                yield chunk
        finally:
            future.cancel()


async def _start(manager: TokenizerManager) -> None:
    manager.ensure_started()


async def _collect_or_error(manager: TokenizerManager, obj: GenerateReqInput) -> dict:
    try:
        return await collect(manager, obj)
    except RequestError as e:
        reason = finish_abort(e.message, e.status_code, e.err_type, e.param)
        meta = {"id": obj.rid, "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
                "finish_reason": reason, "e2e_latency": 0.0}  # fmt: skip
        return {"text": "", "output_ids": [], "meta_info": meta, "error": e.message}


async def _pump(manager: TokenizerManager, obj: GenerateReqInput, put) -> None:
    try:
        async for out in manager.generate_request(obj):
            if is_abort(out):
                put(("error", abort_to_error(out)))
                return
            put(("out", out))
        put(("end", None))
    except Exception as e:
        put(("error", e))


class _StreamDelta:
    """Turns cumulative outputs into chunks: the new text and ids since the last chunk."""

    def __init__(self) -> None:
        self.text_len = 0
        self.ids_len = 0

    def take(self, item: tuple[str, object]) -> dict | None:
        """The chunk of a pumped ("out", output) item; None at the ("end", None) item; raises the
        error of an ("error", exception) item."""
        kind, value = item
        if kind == "error":
            raise value
        return None if kind == "end" else self(value)

    def __call__(self, out: dict) -> dict:
        text, ids = out["text"], out["output_ids"]
        chunk = {
            "text": text[self.text_len :],
            "output_ids": ids[self.ids_len :],
            "meta_info": out["meta_info"],
        }
        self.text_len, self.ids_len = max(self.text_len, len(text)), len(ids)
        return chunk


def _make_requests(args: dict) -> tuple[list[GenerateReqInput], bool]:
    """`generate`'s arguments (its locals) as requests, normalised (`prompt` is the `text`)."""
    fields = {("text" if name == "prompt" else name): value for name, value in args.items() if name != "self"}
    try:
        objs, single = GenerateReqInput(**fields).normalize_batch_and_arguments()
    except RequestError as e:
        raise ArgumentError(e.message, param=e.param) from None
    if fields["stream"] and not single:
        raise ArgumentError("stream=True takes a single prompt with n == 1", param="stream")
    return objs, single


class ArgumentError(RequestError, ValueError):
    """generate's arguments are of a bad shape: a RequestError (400, the field named) that is also
    the ValueError these have always been."""
