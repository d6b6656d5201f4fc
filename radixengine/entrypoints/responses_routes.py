"""OpenAI's Responses API on the chat path: POST /v1/responses (whole, streamed as Responses
events, or in the background), GET / DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel.
A stored response (`store`, the default) can be continued with `previous_response_id`: its
conversation is put before the new input, so the prompt extends the last one (a radix cache hit)."""

from __future__ import annotations

import asyncio
import json
import re
from contextlib import contextmanager

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from radixengine.entrypoints import openai_serving as oai
from radixengine.entrypoints import openai_streams
from radixengine.entrypoints.http_errors import error_response
from radixengine.entrypoints.openai_protocol import ChatCompletionRequest
from radixengine.entrypoints.request_fields import parse_json, parse_model
from radixengine.entrypoints.request_runner import (
    SSEFormat,
    collect_all,
    merged_stream,
    sse_response,
    tag_routing_key,
    tm_of,
    with_disconnect_abort,
)
from radixengine.entrypoints.response_input_items import input_items, page_of
from radixengine.entrypoints.response_store import ResponseStore, StoredResponse
from radixengine.entrypoints.responses_protocol import (
    ResponsesRequest,
    chat_body,
    check_unsupported,
    input_messages,
)
from radixengine.entrypoints.responses_serving import (
    ResponseEvents,
    UsageCounter,
    assistant_messages,
    base_response,
    item_id,
    response_events,
    response_from_chat,
)
from radixengine.managers.io_struct import GenerateReqInput
from radixengine.managers.request_errors import RequestError
from radixengine.managers.tokenizer_manager import TokenizerManager
from radixengine.utils.unicode_check import dumps_json_text

router = APIRouter()


def _encode(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {dumps_json_text(event)}\n\n".encode()


def _error_event(message: str, err_type: str, param: str | None, code: int) -> dict:
    return {"type": "error", "code": err_type, "message": message, "param": param, "sequence_number": 0}


RESPONSES_SSE = SSEFormat(_encode, _error_event, b"")


def store_of(request: Request) -> ResponseStore:
    return request.app.state.response_store


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    req = parse_model(ResponsesRequest, await parse_json(request))
    with responses_params():
        return await _create(request, req)


async def _create(request: Request, req: ResponsesRequest) -> Response:
    tm, store = tm_of(request), store_of(request)
    check_unsupported(req)
    req.model = req.model or tm.served_model_name
    history = _history(store, req.previous_response_id)
    conversation = history + input_messages(req)
    items = input_items(req.input)
    chat_req = parse_model(ChatCompletionRequest, chat_body(req, history, conversation[len(history) :]))
    oai.apply_sampling_defaults(chat_req, tm.default_sampling_params)
    objs = oai.chat_requests(tm, chat_req)
    tag_routing_key(request, objs)
    base = base_response(req, item_id("resp"), "queued" if req.background else "in_progress")
    if req.background:
        return _start_background(tm, store, chat_req, objs, base, conversation, items)
    if req.stream:
        events = ResponseEvents(base, _usage_counter(tm))
        chunks = openai_streams.chat_stream(tm, chat_req, merged_stream(tm, objs))
        stream = _keeping(store, req, conversation, items, response_events(events, chunks))
        return await sse_response(request, stream, objs, RESPONSES_SSE)
    outs = await with_disconnect_abort(request, collect_all(tm, objs), objs)
    if isinstance(outs, Response):
        return outs
    response = response_from_chat(base, oai.chat_response(tm, chat_req, outs), _usage_counter(tm))
    if req.store:
        store.put(StoredResponse(response, conversation + assistant_messages(response["output"]), items))
    return JSONResponse(response)


def _history(store: ResponseStore, previous_id: str | None) -> list[dict]:
    if previous_id is None:
        return []
    entry = store.get(previous_id)
    if entry is None:
        raise RequestError(
            f"Previous response with id {previous_id!r} not found.", param="previous_response_id"
        )
    if entry.response["status"] not in ("completed", "incomplete"):
        raise RequestError(
            f"Previous response {previous_id!r} is {entry.response['status']}, not completed",
            param="previous_response_id",
        )
    return [dict(m) for m in entry.messages]


def _usage_counter(tm: TokenizerManager) -> UsageCounter:
    return UsageCounter(
        lambda text: len(tm.tokenizer.encode(text, add_special_tokens=False)),
        caches_prompts=not tm.server_args.disable_radix_cache,
    )


async def _keeping(
    store: ResponseStore, req: ResponsesRequest, conversation: list[dict], items: list[dict], events
):
    """The stream's events; the finished response is stored (when asked) as it goes out."""
    async for event in events:
        if req.store and event["type"] in ("response.completed", "response.incomplete"):
            response = event["response"]
            store.put(StoredResponse(response, conversation + assistant_messages(response["output"]), items))
        yield event


def _start_background(
    tm: TokenizerManager,
    store: ResponseStore,
    chat_req: ChatCompletionRequest,
    objs: list[GenerateReqInput],
    base: dict,
    conversation: list[dict],
    items: list[dict],
) -> Response:
    entry = StoredResponse(base, input_items=items)
    queued = json.loads(json.dumps(base))

    async def run() -> None:
        try:
            outs = await collect_all(tm, objs)
            entry.response = response_from_chat(
                dict(base), oai.chat_response(tm, chat_req, outs), _usage_counter(tm)
            )
            entry.messages = conversation + assistant_messages(entry.response["output"])
        except asyncio.CancelledError:
            entry.response = {**base, "status": "cancelled"}
            raise
        except RequestError as e:
            entry.response = {**base, "status": "failed", "error": {"code": e.err_type, "message": e.message}}
        finally:
            if store.get(base["id"]) is entry:  # not deleted meanwhile
                store.put(entry)

    base["status"] = "in_progress"
    entry.task = asyncio.ensure_future(run())
    store.put(entry)
    return JSONResponse(queued)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    entry = store_of(request).get(response_id)
    if entry is None:
        return _not_found(response_id)
    return JSONResponse(entry.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    entry = store_of(request).delete(response_id)
    if entry is None:
        return _not_found(response_id)
    if entry.running:
        entry.task.cancel()
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> Response:
    store = store_of(request)
    entry = store.get(response_id)
    if entry is None:
        return _not_found(response_id)
    if not entry.response.get("background"):
        return error_response("Only background responses can be cancelled.", 400, param="response_id")
    if entry.running:
        entry.task.cancel()
        await asyncio.wait({entry.task})
    return JSONResponse(entry.response)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    request: Request, response_id: str, after: str | None = None, limit: int = 20, order: str = "desc"
) -> Response:
    """OpenAI's list of the input items a response was made from (`include` is accepted: the
    items carry all they have)."""
    entry = store_of(request).get(response_id)
    if entry is None:
        return _not_found(response_id)
    return JSONResponse(page_of(entry.input_items, after, limit, order))


def _not_found(response_id: str) -> Response:
    return error_response(f"Response with id {response_id!r} not found.", 404, param="response_id")


# Chat's parameter names in errors -> the Responses API's
_PARAMS = [
    (re.compile(r"^messages\b.*"), "input"),
    (re.compile(r"^max_(completion_)?tokens$"), "max_output_tokens"),
    (re.compile(r"^response_format\b.*"), "text.format"),
    (re.compile(r"^(tools\[\d+\])\.function\."), r"\1."),
    (re.compile(r"^tool_choice\.function\."), "tool_choice."),
]


@contextmanager
def responses_params():
    try:
        yield
    except RequestError as e:
        for pattern, name in _PARAMS:
            if e.param and pattern.search(e.param):
                new = pattern.sub(name, e.param)
                e.message, e.param = e.message.replace(e.param, new), new
                break
        raise
