"""The HTTP server: the app that assembles the routers, one per API (native_routes: SGLang's native
API; openai_routes: the OpenAI-compatible one; operations_routes: health, metrics, server info and
load; lora_routes: loading LoRA adapters), over the TokenizerManager; and its launch. docs/api.md lists the routes.

FastAPI + uvicorn, one worker; the TokenizerManager lives in uvicorn's event loop, the scheduler
and detokenizer in child processes. Errors are OpenAI-style JSON, `{"error": {"message", "type",
"param", "code"}}`, with the HTTP status: 400 bad input, 401 missing API key, 404 unknown route,
405 wrong method, 503 queue full or engine down. CORS is open to any origin, as in SGLang."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixengine.entrypoints import (
    batches_routes,
    files_routes,
    lora_routes,
    native_routes,
    openai_routes,
    operations_routes,
    responses_routes,
)
from radixengine.entrypoints.auth import APIKeyMiddleware
from radixengine.entrypoints.batch_runner import BatchRunner
from radixengine.entrypoints.batch_store import BatchStore, default_batch_dir
from radixengine.entrypoints.file_store import FileStore
from radixengine.entrypoints.http_errors import error_response
from radixengine.entrypoints.response_store import ResponseStore
from radixengine.managers.request_errors import EngineDeadError, RequestError
from radixengine.managers.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

READY_MESSAGE = "The server is fired up and ready to roll! Ready on http://{host}:{port}"


def create_app(tm: TokenizerManager, server_args) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tm.ensure_started()
        runner = app.state.batch_runner = batch_runner(tm, server_args)
        if runner is not None:
            runner.resume_all()
        yield
        if runner is not None:
            await runner.stop()
        await tm.aclose()

    app = FastAPI(lifespan=lifespan)
    app.state.tokenizer_manager = tm
    app.state.response_store = ResponseStore(
        server_args.response_store_max_count, server_args.response_store_max_bytes
    )
    _install_error_handlers(app)
    if server_args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server_args.api_key)
    # As SGLang: any origin, method and header. Added last, so outermost: it answers preflights
    # before the API key is asked for, and puts its headers on a 401 too.
    app.add_middleware(
        CORSMiddleware, allow_origins=["*"], allow_credentials=True, allow_methods=["*"], allow_headers=["*"]
    )
    for module in (
        native_routes,
        openai_routes,
        responses_routes,
        files_routes,
        batches_routes,
        operations_routes,
        lora_routes,
    ):
        app.include_router(module.router)
    return app


def batch_runner(tm: TokenizerManager, server_args) -> BatchRunner | None:
    """The runner of /v1/batches over the files and batches of --batch-dir; None (the routes
    answer 503) when another server holds that folder (two would run its batches twice) or it
    cannot be created."""
    root = Path(server_args.batch_dir or default_batch_dir())
    try:
        batches, files = BatchStore(root / "batches"), FileStore(root / "files")
        locked = batches.lock()
    except OSError as e:
        logger.warning("--batch-dir %s cannot be used (%s): /v1/files and /v1/batches are off", root, e)
        return None
    if not locked:
        logger.warning("--batch-dir %s is used by another server: /v1/files and /v1/batches are off", root)
        return None
    return BatchRunner(tm, files, batches, server_args)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(_: Request, e: RequestError):
        return error_response(e.message, e.status_code, e.param, e.err_type)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError):
        return error_response(str(e), 503, err_type="EngineDeadError")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        headers = e.headers or {}
        message = str(e.detail)
        if e.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif e.status_code == 405:
            allowed = headers.get("Allow")
            message = f"method {request.method} is not allowed on {request.url.path} (allowed: {allowed})"
        response = error_response(message, e.status_code)
        response.headers.update(headers)
        return response

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception):
        logger.exception("internal error")
        return error_response(f"internal error: {type(e).__name__}: {e}", 500)


# Launch ---------------------------------------------------------------------------------------


GRACEFUL_SHUTDOWN_S = 10  # after SIGINT / SIGTERM, how long open requests may still finish


class ServerStartError(Exception):
    """The server could not start (its address, the model, a flag): the message says why."""


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, tm: TokenizerManager) -> None:
        super().__init__(config)
        self.tm = tm
        self.child_died = False
        tm.on_dead = self._on_child_dead

    def _on_child_dead(self, _: str) -> None:
        self.child_died = True
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        # A signal to the whole process group ends the children too: that is this shutdown, not a crash.
        self.tm.stopping = True
        super().handle_exit(sig, frame)


def check_address(host: str, port: int) -> None:
    """Refuse an address that cannot be listened on before the model loads (uvicorn binds later)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as e:
        raise ServerStartError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def launch_server(server_args) -> None:
    """Start the child processes, then serve until SIGINT / SIGTERM, or until a child dies past
    what --max-scheduler-restarts allows (then exit 1)."""
    from radixengine.engine import launch_subprocesses, shutdown_subprocesses

    logging.basicConfig(level=server_args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    check_address(server_args.host, server_args.port)
    try:
        tm = launch_subprocesses(server_args, restart=True)
    except (OSError, ValueError, RuntimeError) as e:
        logger.debug("start-up failed", exc_info=True)
        raise ServerStartError(str(e)) from e
    server = _make_server(tm, server_args)
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then re-raises the signal to the handler
    # it found: make that one a no-op, so that the child processes are ended below and we exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        asyncio.run(_serve(server, server_args))
    finally:
        shutdown_subprocesses(tm)
    if server.child_died or not server.started:
        raise SystemExit(1)


def _make_server(tm: TokenizerManager, server_args) -> _Server:
    config = uvicorn.Config(
        create_app(tm, server_args),
        host=server_args.host,
        port=server_args.port,
        log_level=server_args.log_level,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    return _Server(config, tm)


async def _serve(server: _Server, server_args) -> None:
    """Serve until uvicorn stops; the ready message once it listens."""
    task = asyncio.ensure_future(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        logger.info(READY_MESSAGE.format(host=server_args.host, port=server_args.port))
    await task
