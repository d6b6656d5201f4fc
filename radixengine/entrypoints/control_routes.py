"""Acting on the engine: /abort_request and /flush_cache (SGLang's paths and bodies)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from radixengine.entrypoints.http_errors import error_response
from radixengine.entrypoints.request_fields import parse_json, read_fields
from radixengine.managers.tokenizer_manager import RequestError

router = APIRouter()


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """`{"rid": ...}` or `{"abort_all": true}`: the request(s) end at once; their clients get the
    abort (status 499) as the answer. 200 whether or not the rid was running (as SGLang)."""
    body = read_fields(await parse_json(request), ("rid", "abort_all", "abort_message"), "/abort_request")
    rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
    if not isinstance(rid, str):
        raise RequestError("rid must be a string", param="rid")
    if not isinstance(abort_all, bool):
        raise RequestError("abort_all must be a boolean", param="abort_all")
    if not rid and not abort_all:
        raise RequestError("give a rid, or abort_all: true", param="rid")
    request.app.state.tokenizer_manager.abort_for_client(rid, abort_all)
    return Response(status_code=200)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    result = await request.app.state.tokenizer_manager.flush_cache()
    if not result.success:
        return error_response(result.message or "cannot flush the cache while requests run", 400)
    return PlainTextResponse("Cache flushed.\n")
