"""The HTTP server: SGLang's native API and the OpenAI-compatible one over the TokenizerManager.

FastAPI + uvicorn, one worker; the TokenizerManager lives in uvicorn's event loop, the scheduler
and detokenizer in child processes. This module holds the generation routes (/generate, chat,
completions) and the app; info_routes, control_routes and tokenize_routes the rest (docs/api.md
lists them all). Errors are OpenAI-style JSON, `{"error": {"message", "type", "param", "code"}}`,
with the HTTP status: 400 bad input, 401 missing API key, 404 unknown route, 503 queue full or
engine down."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager, contextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixengine.entrypoints import control_routes, info_routes, tokenize_routes
from radixengine.entrypoints import openai_serving as oai
from radixengine.entrypoints.auth import APIKeyMiddleware
from radixengine.entrypoints.http_errors import error_response
from radixengine.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from radixengine.entrypoints.request_fields import parse_json, parse_model, read_fields
from radixengine.managers.io_struct import GenerateReqInput
from radixengine.managers.tokenizer_manager import (
    EngineDeadError,
    RequestError,
    TokenizerManager,
    abort_to_error,
    is_abort,
)

logger = logging.getLogger(__name__)

READY_MESSAGE = "The server is fired up and ready to roll! Ready on http://{host}:{port}"


# Running requests -----------------------------------------------------------------------------


async def collect(tm: TokenizerManager, obj: GenerateReqInput) -> dict:
    out = None
    async for chunk in tm.generate_request(obj):
        out = chunk
    if out is None or is_abort(out):
        raise abort_to_error(out) if out is not None else RequestError("no output", 500)
    return out


async def collect_all(tm: TokenizerManager, objs: list[GenerateReqInput]) -> list[dict]:
    """All requests' final outputs; the first failure (or a cancel) aborts the others, and
    returns once their aborts are sent."""
    tasks = [asyncio.ensure_future(collect(tm, o)) for o in objs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)


async def merged_stream(
    tm: TokenizerManager, objs: list[GenerateReqInput]
) -> AsyncIterator[tuple[int, dict]]:
    """(index, output) of several streaming requests as they come; aborts all on exit."""
    if len(objs) == 1:
        gen = tm.generate_request(objs[0])
        try:
            async for out in gen:
                yield 0, out
        finally:
            await gen.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, obj: GenerateReqInput) -> None:
        try:
            async for out in tm.generate_request(obj):
                await queue.put((i, out))
        except Exception as e:
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, o)) for i, o in enumerate(objs)]
    try:
        pending = len(tasks)
        while pending:
            i, item = await queue.get()
            if item is None:
                pending -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def with_disconnect_abort(request: Request, coro: Awaitable, objs: list[GenerateReqInput]):
    """Await `coro`; if the client goes away first, cancel it (which aborts its requests) and
    answer 499. The body is read by then, so the next ASGI message is the client's disconnect:
    it is seen the moment it happens."""
    task = asyncio.ensure_future(coro)
    disconnect = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.wait({task})  # its requests' aborts are sent
        logger.info("client disconnected; aborted request(s) %s", ", ".join(_rids(objs)))
        return Response(status_code=499)
    finally:
        task.cancel()
        disconnect.cancel()


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _rids(objs: list[GenerateReqInput]) -> list[str]:
    return [str(o.rid) for o in objs]


async def _first_event(events: AsyncIterator[dict]) -> dict | None:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


async def sse_response(
    request: Request, events: AsyncIterator[dict], objs: list[GenerateReqInput]
) -> Response:
    """Start the stream only once its first event is there, so that a refused request gets its
    HTTP status instead of a 200 with an error inside. A client that leaves before (a queued
    request) or during the stream gets its requests aborted."""
    try:
        first = await with_disconnect_abort(request, _first_event(events), objs)
    except BaseException:
        await events.aclose()
        raise
    if isinstance(first, Response):  # the client left
        await events.aclose()
        return first

    async def body() -> AsyncIterator[bytes]:
        complete = False
        try:
            if first is not None:
                yield _sse(first)
                async for event in events:
                    yield _sse(event)
            complete = True
        except RequestError as e:
            complete = True
            yield _sse(
                {"error": {"message": e.message, "type": e.err_type, "param": e.param, "code": e.status_code}}
            )
        except EngineDeadError as e:
            complete = True
            yield _sse({"error": {"message": str(e), "type": "EngineDeadError", "param": None, "code": 503}})
        finally:
            await events.aclose()
            if not complete:
                logger.info("client disconnected mid-stream; aborted request(s) %s", ", ".join(_rids(objs)))
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


# The app --------------------------------------------------------------------------------------


def create_app(tm: TokenizerManager, server_args) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tm.ensure_started()
        yield
        await tm.aclose()

    app = FastAPI(lifespan=lifespan)
    app.state.tokenizer_manager = tm
    _install_error_handlers(app)
    if server_args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server_args.api_key)
    for module in (info_routes, control_routes, tokenize_routes):
        app.include_router(module.router)

    @app.get("/health")
    async def health() -> Response:
        if tm.dead_error is not None:
            return error_response(tm.dead_error, 503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        obj = GenerateReqInput(
            input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0}, log_metrics=False
        )
        try:
            await asyncio.wait_for(collect(tm, obj), timeout=60)
        except (RequestError, EngineDeadError, asyncio.TimeoutError) as e:
            return error_response(f"health check failed: {e}", 503)
        return Response(status_code=200)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        objs, single = native_requests(await parse_json(request))
        tag_routing_key(request, objs)
        if objs[0].stream:
            return await sse_response(request, _native_events(tm, objs, single), objs)
        if single:
            result = await with_disconnect_abort(request, collect(tm, objs[0]), objs)
        else:
            result = await with_disconnect_abort(request, collect_all(tm, objs), objs)
        return result if isinstance(result, Response) else JSONResponse(result)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_model(CompletionRequest, await parse_json(request))
        with openai_params("prompt", "max_tokens"):
            return await _completions(request, req)

    async def _completions(request: Request, req: CompletionRequest) -> Response:
        _fill_defaults(tm, req)
        objs, prompts = oai.completion_requests(tm, req)
        tag_routing_key(request, objs)
        if req.stream:
            return await sse_response(
                request, oai.completion_stream(tm, req, merged_stream(tm, objs), prompts), objs
            )
        outs = await with_disconnect_abort(request, collect_all(tm, objs), objs)
        if isinstance(outs, Response):
            return outs
        return JSONResponse(oai.completion_response(tm, req, outs, prompts))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_model(ChatCompletionRequest, await parse_json(request))
        max_tokens = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        with openai_params("messages", max_tokens):
            return await _chat_completions(request, req)

    async def _chat_completions(request: Request, req: ChatCompletionRequest) -> Response:
        _fill_defaults(tm, req)
        oai.apply_sampling_defaults(req, tm.default_sampling_params)
        objs = oai.chat_requests(tm, req)
        tag_routing_key(request, objs)
        if req.stream:
            return await sse_response(request, oai.chat_stream(tm, req, merged_stream(tm, objs)), objs)
        outs = await with_disconnect_abort(request, collect_all(tm, objs), objs)
        if isinstance(outs, Response):
            return outs
        return JSONResponse(oai.chat_response(tm, req, outs))

    @app.get("/metrics")
    async def metrics() -> Response:
        if tm.metrics is None:
            return error_response("metrics are disabled (--enable-metrics is off)", 404)
        try:
            state = await tm.get_internal_state()
        except (asyncio.TimeoutError, EngineDeadError):
            state = None
        return Response(tm.metrics.render(state), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _fill_defaults(tm: TokenizerManager, req: CompletionRequest | ChatCompletionRequest) -> None:
    """The answer names the model the request named (SGLang's rule), else the served name."""
    req.model = req.model or tm.served_model_name
    if req.seed is None:
        req.seed = req.sampling_seed


@contextmanager
def openai_params(prompt_param: str, max_tokens_param: str):
    """Name the OpenAI field in errors the engine reports under its own names."""
    names = {
        "text": prompt_param,
        "input_ids": prompt_param,
        "messages": prompt_param,
        "max_new_tokens": max_tokens_param,
        "min_new_tokens": "min_tokens",
        "sampling_seed": "seed",
    }
    try:
        yield
    except RequestError as e:
        e.param = names.get(e.param, e.param)
        raise


NATIVE_FIELDS = {
    "text", "input_ids", "sampling_params", "stream", "rid", "priority", "return_logprob", "top_logprobs_num",
    "logprob_start_len", "return_text_in_logprobs", "routing_key",
}  # fmt: skip
# Accepted for SGLang's clients (sglang-router adds them): `model` names the one model, `no_logs`
# changes nothing here, `log_metrics: false` keeps the request out of the metrics.
NATIVE_COMPAT_FIELDS = {"model", "no_logs", "log_metrics"}
# Given once for every prompt, or as a list with one per prompt (SGLang's batch form).
NATIVE_LOGPROB_FIELDS = ("return_logprob", "top_logprobs_num", "logprob_start_len")


ROUTING_KEY_HEADERS = ("x-smg-routing-key", "x-tenant")  # SGLang's header, and a plain one


def tag_routing_key(request: Request, objs: list[GenerateReqInput]) -> None:
    """The tenant of --schedule-policy dlpm: a /generate body's routing_key, else a header."""
    header = next((request.headers[h] for h in ROUTING_KEY_HEADERS if h in request.headers), None)
    for obj in objs:
        if obj.routing_key is None:
            obj.routing_key = header


def native_requests(body: object) -> tuple[list[GenerateReqInput], bool]:
    """SGLang's /generate body: text or input_ids (one prompt or a batch), sampling_params (one,
    or one per prompt), rid (a string, or one per prompt), stream, priority, return_logprob,
    top_logprobs_num, logprob_start_len (each one, or one per prompt), return_text_in_logprobs.
    `sampling_params.n` > 1 asks for n samples of each prompt (seed + j for the
    j-th when a seed is given): the answer is then a list, prompt by prompt, n samples each, as
    for a batch. A null field is unset; an unknown top-level field is ignored (one inside
    sampling_params is an error). Returns the requests and whether the answer is a single object."""
    body = read_fields(body, NATIVE_FIELDS | NATIVE_COMPAT_FIELDS, "/generate")
    prompts, kind, single = _native_prompts(body)
    params = _per_prompt(body.get("sampling_params"), len(prompts), "sampling_params")
    priorities = _per_prompt(body.get("priority"), len(prompts), "priority")
    logprob_fields = {name: _per_prompt(body.get(name), len(prompts), name) for name in NATIVE_LOGPROB_FIELDS}
    for name in ("stream", "log_metrics", "return_text_in_logprobs", "no_logs"):
        if not isinstance(body.get(name, False), bool):
            raise RequestError(f"{name} must be a boolean", param=name)
    n = _num_samples(params)
    rids = _native_rids(body.get("rid"), len(prompts), n, single)
    objs = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            obj = GenerateReqInput(
                sampling_params=_sample_params(params[i], j, n),
                rid=rids[i * n + j],
                priority=priorities[i],
                routing_key=body.get("routing_key"),
                stream=body.get("stream", False),
                return_text_in_logprobs=body.get("return_text_in_logprobs", False),
                **{name: values[i] for name, values in logprob_fields.items()},
                log_metrics=body.get("log_metrics", True),
            )
            setattr(obj, kind, prompt)
            objs.append(obj)
    return objs, single and n == 1


def _native_prompts(body: dict) -> tuple[list, str, bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("give exactly one of text or input_ids", param="text")
    kind = "text" if text is not None else "input_ids"
    single = isinstance(text, str) or (ids is not None and not (ids and isinstance(ids[0], list)))
    prompts = [body[kind]] if single else body[kind]
    if not isinstance(prompts, list) or not prompts:
        raise RequestError(f"{kind} must be a prompt or a non-empty list of prompts", param=kind)
    return prompts, kind, single


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for {n} prompts", param=name)
        return value
    return [value] * n


def _num_samples(params: list) -> int:
    """n of the sampling params: the same for every prompt (SGLang's rule)."""
    values = set()
    for p in params:
        if p is not None and not isinstance(p, dict):
            raise RequestError(
                "sampling_params must be an object (or a list of them)", param="sampling_params"
            )
        n = (p or {}).get("n")
        n = 1 if n is None else n
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise RequestError(f"n must be a positive integer, got {n!r}", param="n")
        values.add(n)
    if len(values) > 1:
        raise RequestError("n must be the same in every prompt's sampling_params", param="n")
    return values.pop()


def _sample_params(params: dict | None, j: int, n: int) -> dict | None:
    if n == 1:
        return params
    sample = dict(params, n=1)
    seed = sample.get("sampling_seed")
    if isinstance(seed, int) and not isinstance(seed, bool):  # anything else is refused later
        sample["sampling_seed"] = seed + j
    return sample


def _native_rids(rid: object, num_prompts: int, n: int, single: bool) -> list[str | None]:
    """One rid per request (prompt by prompt, n samples each). SGLang's rule: a string names a
    single request, and is suffixed `_k` (k = 0, 1, ...) when it stands for several; a list gives
    one per prompt (suffixed `_j` per sample when n > 1)."""
    total = num_prompts * n
    if rid is None:
        return [None] * total
    if isinstance(rid, str):
        return [rid] if single and n == 1 else [f"{rid}_{k}" for k in range(total)]
    if not isinstance(rid, list) or not all(isinstance(r, str) for r in rid):
        raise RequestError(
            f"rid must be a string or a list of strings, got {type(rid).__name__}", param="rid"
        )
    if single:
        raise RequestError("rid must be a string for a single prompt (a list is for a batch)", param="rid")
    if len(rid) != num_prompts:
        raise RequestError(f"rid has {len(rid)} entries for {num_prompts} prompts", param="rid")
    return list(rid) if n == 1 else [f"{r}_{j}" for r in rid for j in range(n)]


async def _native_events(
    tm: TokenizerManager, objs: list[GenerateReqInput], single: bool
) -> AsyncIterator[dict]:
    """A single request's outputs, or several requests' outputs as they come, each with the
    `index` of its request (SGLang's batch stream)."""
    gen = merged_stream(tm, objs)
    try:
        async for i, out in gen:
            if is_abort(out):
                raise abort_to_error(out)
            yield out if single else {**out, "index": i}
    finally:
        await gen.aclose()


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(_: Request, e: RequestError):
        return error_response(e.message, e.status_code, e.param, e.err_type)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError):
        return error_response(str(e), 503, err_type="EngineDeadError")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = (
            f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        )
        return error_response(message, e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception):
        logger.exception("internal error")
        return error_response(f"internal error: {type(e).__name__}: {e}", 500)


# Launch ---------------------------------------------------------------------------------------


def launch_server(server_args) -> None:
    """Start the child processes, then serve until SIGINT / SIGTERM (or a child dies)."""
    import uvicorn

    from radixengine.engine import launch_subprocesses, shutdown_subprocesses

    logging.basicConfig(level=server_args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    tm = launch_subprocesses(server_args)
    app = create_app(tm, server_args)
    config = uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        log_level=server_args.log_level,
        timeout_keep_alive=5,
    )
    server = uvicorn.Server(config)
    exit_code = 0

    def on_dead(_: str) -> None:
        nonlocal exit_code
        exit_code = 1
        server.should_exit = True

    tm.on_dead = on_dead
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then re-raises the signal to the handler
    # it found: make that one a no-op, so that the child processes are ended below and we exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)

    async def serve() -> None:
        task = asyncio.ensure_future(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            logger.info(READY_MESSAGE.format(host=server_args.host, port=server_args.port))
        await task

    try:
        asyncio.run(serve())
    finally:
        shutdown_subprocesses(tm)
    if exit_code or not server.started:
        raise SystemExit(exit_code or 1)
