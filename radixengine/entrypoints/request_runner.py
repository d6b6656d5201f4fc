"""Running generation requests for an HTTP route: all of them to their final outputs, several
streams merged as they come, Server-Sent Events, and the client's disconnect (which aborts the
route's requests)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixengine.managers.io_struct import GenerateReqInput
from radixengine.managers.request_errors import EngineDeadError, RequestError
from radixengine.managers.tokenizer_manager import TokenizerManager, collect
from radixengine.utils.unicode_check import encode_json_text

logger = logging.getLogger(__name__)


def tm_of(request: Request) -> TokenizerManager:
    """The app's TokenizerManager (create_app puts it in the app's state)."""
    return request.app.state.tokenizer_manager


async def serve_requests(
    request: Request,
    objs: list[GenerateReqInput],
    events: Callable[[AsyncIterator[tuple[int, dict]]], AsyncIterator[dict]],
    answer: Callable[[list[dict]], object],
    keep_requested_aborts: bool = False,
) -> Response:
    """A route's requests: when they stream, Server-Sent Events of `events` (the outputs of all,
    merged as they come, as the route's chunks); else the JSON of `answer` (their final outputs;
    with `keep_requested_aborts`, an /abort_request's abort is an output, not an error).
    A client that leaves gets its requests aborted."""
    tm = tm_of(request)
    tag_routing_key(request, objs)
    if objs[0].stream:
        return await sse_response(request, events(merged_stream(tm, objs)), objs)
    outs = await with_disconnect_abort(request, collect_all(tm, objs, keep_requested_aborts), objs)
    return outs if isinstance(outs, Response) else ModelOutputResponse(answer(outs))


class ModelOutputResponse(JSONResponse):
    """JSONResponse whose text UTF-8 can always encode (a lone surrogate a model's JSON escape
    gave a string is sent as that escape), never a 500 for what a model wrote."""

    def render(self, content: object) -> bytes:
        return encode_json_text(content, allow_nan=False, separators=(",", ":"))


ROUTING_KEY_HEADERS = ("x-smg-routing-key", "x-tenant")  # SGLang's header, and a plain one


def tag_routing_key(request: Request, objs: list[GenerateReqInput]) -> None:
    """The tenant of --schedule-policy dlpm: a request's own routing_key (the /generate body's),
    else the route's header."""
    header = next((request.headers[h] for h in ROUTING_KEY_HEADERS if h in request.headers), None)
    for obj in objs:
        if obj.routing_key is None:
            obj.routing_key = header


async def collect_all(
    tm: TokenizerManager, objs: list[GenerateReqInput], keep_requested_aborts: bool = False
) -> list[dict]:
    """All requests' final outputs; the first failure (or a cancel) aborts the others, and
    returns once their aborts are sent."""
    tasks = [asyncio.ensure_future(collect(tm, o, keep_requested_aborts)) for o in objs]
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


def _error_event(message: str, err_type: str, param: str | None, code: int) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


@dataclass(frozen=True)
class SSEFormat:
    """How a route's events are written: each event's bytes, the event an error mid-stream
    becomes, and the closing line (chat and completions: `data: [DONE]`)."""

    encode: Callable[[dict], bytes]
    error_event: Callable[[str, str, str | None, int], dict] = _error_event
    done: bytes = b"data: [DONE]\n\n"


def _sse(obj: dict) -> bytes:
    return b"data: " + encode_json_text(obj) + b"\n\n"


CHAT_SSE = SSEFormat(_sse)


async def sse_response(
    request: Request, events: AsyncIterator[dict], objs: list[GenerateReqInput], fmt: SSEFormat = CHAT_SSE
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
                yield fmt.encode(first)
                async for event in events:
                    yield fmt.encode(event)
            complete = True
        except RequestError as e:
            complete = True
            yield fmt.encode(fmt.error_event(e.message, e.err_type, e.param, e.status_code))
        except EngineDeadError as e:
            complete = True
            yield fmt.encode(fmt.error_event(str(e), "EngineDeadError", None, 503))
        finally:
            await events.aclose()
            if not complete:
                logger.info("client disconnected mid-stream; aborted request(s) %s", ", ".join(_rids(objs)))
        yield fmt.done

    return StreamingResponse(body(), media_type="text/event-stream")
