"""The HTTP server: SGLang's native API and the OpenAI-compatible one over the TokenizerManager.

FastAPI + uvicorn, one worker; the TokenizerManager lives in uvicorn's event loop, the scheduler
and detokenizer in child processes. Errors are OpenAI-style JSON, `{"error": {"message", "type",
"param", "code"}}`, with the HTTP status: 400 bad input, 401 missing API key, 404 unknown route,
503 queue full or engine down."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager, contextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixengine.entrypoints import openai_serving as oai
from radixengine.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from radixengine.managers.io_struct import GenerateReqInput
from radixengine.managers.tokenizer_manager import (
    EngineDeadError,
    RequestError,
    TokenizerManager,
    abort_to_error,
    is_abort,
)

logger = logging.getLogger(__name__)

DISCONNECT_POLL_INTERVAL = 0.5
READY_MESSAGE = "The server is fired up and ready to roll! Ready on http://{host}:{port}"


# Errors ---------------------------------------------------------------------------------------


def error_response(message: str, status_code: int = 400, param: str | None = None, err_type: str | None = None):
    if err_type is None:
        err_type = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}.get(
            status_code, "ServiceUnavailableError" if status_code == 503 else "InternalServerError"
        )
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status_code}}
    return JSONResponse(body, status_code=status_code)


def validation_error_to_request_error(e: ValidationError) -> RequestError:
    err = e.errors()[0]
    param = _loc_to_param(err.get("loc", ()))
    if err.get("type") == "extra_forbidden":
        return RequestError(f"unknown field {param!r}", param=param)
    return RequestError(f"{param}: {err.get('msg', 'invalid value')}", param=param)


def _loc_to_param(loc: tuple) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif "[" in item or item in ("str", "int", "float", "bool", "dict", "list", "none") or "-" in item:
            continue  # pydantic's union-member tags
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or "body"


async def parse_json(request: Request) -> object:
    body = await request.body()
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"invalid JSON body: {e}", param="body") from None


def parse_model(model: type[BaseModel], body: object) -> BaseModel:
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object", param="body")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error_to_request_error(e) from None


# Running requests -----------------------------------------------------------------------------


async def collect(tm: TokenizerManager, obj: GenerateReqInput) -> dict:
    out = None
    async for chunk in tm.generate_request(obj):
        out = chunk
    if out is None or is_abort(out):
        raise abort_to_error(out) if out is not None else RequestError("no output", 500)
    return out


async def collect_all(tm: TokenizerManager, objs: list[GenerateReqInput]) -> list[dict]:
    """All requests' final outputs; the first failure cancels (aborts) the others."""
    tasks = [asyncio.ensure_future(collect(tm, o)) for o in objs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


async def merged_stream(tm: TokenizerManager, objs: list[GenerateReqInput]) -> AsyncIterator[tuple[int, dict]]:
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


async def with_disconnect_abort(request: Request, coro: Awaitable):
    """Await `coro`; if the client goes away first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_INTERVAL)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                logger.info("client disconnected; request aborted")
                return Response(status_code=499)
    finally:
        task.cancel()


async def sse_response(events: AsyncIterator[dict]) -> Response:
    """Start the stream only once its first event is there, so that a refused request gets its
    HTTP status instead of a 200 with an error inside."""
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await events.aclose()
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield _sse(first)
                async for event in events:
                    yield _sse(event)
        except RequestError as e:
            yield _sse({"error": {"message": e.message, "type": e.err_type, "param": e.param, "code": e.status_code}})
        except EngineDeadError as e:
            yield _sse({"error": {"message": str(e), "type": "EngineDeadError", "param": None, "code": 503}})
        finally:
            await events.aclose()
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

    @app.get("/health")
    async def health() -> Response:
        if tm.dead_error is not None:
            return error_response(tm.dead_error, 503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
        try:
            await asyncio.wait_for(collect(tm, obj), timeout=60)
        except (RequestError, EngineDeadError, asyncio.TimeoutError) as e:
            return error_response(f"health check failed: {e}", 503)
        return Response(status_code=200)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        objs, single = native_requests(await parse_json(request))
        if any(o.stream for o in objs):
            if not single:
                raise RequestError("stream takes a single prompt", param="stream")
            return await sse_response(_native_events(tm, objs[0]))
        if single:
            result = await with_disconnect_abort(request, collect(tm, objs[0]))
        else:
            result = await with_disconnect_abort(request, collect_all(tm, objs))
        return result if isinstance(result, Response) else JSONResponse(result)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_model(CompletionRequest, await parse_json(request))
        with openai_params("prompt", "max_tokens"):
            return await _completions(request, req)

    async def _completions(request: Request, req: CompletionRequest) -> Response:
        check_model(tm, req.model)
        objs, prompts = oai.completion_requests(tm, req)
        if req.stream:
            return await sse_response(oai.completion_stream(tm, req, merged_stream(tm, objs), len(prompts)))
        outs = await with_disconnect_abort(request, collect_all(tm, objs))
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
        check_model(tm, req.model)
        objs = oai.chat_requests(tm, req)
        if req.stream:
            return await sse_response(oai.chat_stream(tm, req, merged_stream(tm, objs)))
        outs = await with_disconnect_abort(request, collect_all(tm, objs))
        if isinstance(outs, Response):
            return outs
        return JSONResponse(oai.chat_response(tm, req, outs))

    @app.get("/v1/models")
    async def models() -> dict:
        card = ModelCard(id=tm.served_model_name, root=tm.served_model_name, max_model_len=tm.context_len)
        return ModelList(data=[card]).model_dump()

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        result = await tm.flush_cache()
        if not result.success:
            return error_response(result.message or "cannot flush the cache while requests run", 400)
        return PlainTextResponse("Cache flushed.\n")

    @app.get("/get_server_info")
    async def get_server_info() -> dict:
        info = dataclasses.asdict(server_args)
        info.update({k: v for k, v in tm.scheduler_info.items() if k != "status"})
        info.update(await tm.get_internal_state())
        return info

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


def check_model(tm: TokenizerManager, model: str) -> None:
    if model not in (tm.served_model_name, tm.model_path):
        raise RequestError(
            f"the model {model!r} does not exist; this server serves {tm.served_model_name!r}",
            param="model",
        )


def native_requests(body: object) -> tuple[list[GenerateReqInput], bool]:
    """SGLang's /generate body: text or input_ids (one or a batch), sampling_params (one or a
    list), stream, rid, priority, return_logprob."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object", param="body")
    known = {"text", "input_ids", "sampling_params", "stream", "rid", "priority", "return_logprob", "top_logprobs_num"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}", param=unknown[0])
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("give exactly one of text or input_ids", param="text")
    single = isinstance(text, str) or (ids is not None and not (ids and isinstance(ids[0], list)))
    prompts = [text if text is not None else ids] if single else list(text if text is not None else ids)
    if not prompts:
        raise RequestError("the batch is empty", param="text" if text is not None else "input_ids")
    kind = "text" if text is not None else "input_ids"
    per = {name: _per_prompt(body.get(name), len(prompts), name) for name in ("sampling_params", "rid", "priority")}
    for name, kind_ in (("stream", bool), ("return_logprob", bool)):
        if not isinstance(body.get(name, False), kind_):
            raise RequestError(f"{name} must be a boolean", param=name)
    objs = []
    for i, prompt in enumerate(prompts):
        obj = GenerateReqInput(
            sampling_params=per["sampling_params"][i],
            rid=per["rid"][i],
            priority=per["priority"][i],
            stream=body.get("stream", False),
            return_logprob=body.get("return_logprob", False),
        )
        setattr(obj, kind, prompt)
        objs.append(obj)
    return objs, single


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for {n} prompts", param=name)
        return value
    return [value] * n


async def _native_events(tm: TokenizerManager, obj: GenerateReqInput) -> AsyncIterator[dict]:
    gen = tm.generate_request(obj)
    try:
        async for out in gen:
            if is_abort(out):
                raise abort_to_error(out)
            yield out
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
        message = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return error_response(message, e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception):
        logger.exception("internal error")
        return error_response(f"internal error: {type(e).__name__}: {e}", 500)


class APIKeyMiddleware:
    """Every route but /health needs `Authorization: Bearer <key>` (a plain ASGI middleware, so
    that disconnect detection and streaming pass through untouched)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            if dict(scope["headers"]).get(b"authorization") != self.expected:
                response = error_response("invalid or missing API key (Authorization: Bearer ...)", 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# Launch ---------------------------------------------------------------------------------------


def launch_server(server_args) -> None:
    """Start the child processes, then serve until SIGINT / SIGTERM (or a child dies)."""
    import uvicorn

    from radixengine.engine import launch_subprocesses, shutdown_subprocesses

    logging.basicConfig(level=server_args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    tm = launch_subprocesses(server_args)
    app = create_app(tm, server_args)
    config = uvicorn.Config(
        app, host=server_args.host, port=server_args.port, log_level=server_args.log_level, timeout_keep_alive=5
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
