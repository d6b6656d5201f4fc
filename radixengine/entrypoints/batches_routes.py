"""OpenAI's Batch API: POST /v1/batches (over /v1/chat/completions or /v1/completions), GET
/v1/batches (list), GET /v1/batches/{id}, POST /v1/batches/{id}/cancel. The running is
batch_runner's; the state is in the batch folder and survives a restart."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from radixengine.entrypoints.batch_store import public
from radixengine.entrypoints.files_routes import runner_of
from radixengine.entrypoints.http_errors import error_response
from radixengine.entrypoints.request_fields import parse_json
from radixengine.managers.request_errors import RequestError

router = APIRouter()


@router.post("/v1/batches")
async def create_batch(request: Request) -> Response:
    body = await parse_json(request)
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object", param="body")
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(name), str):
            raise RequestError(f"{name} is required (a string)", param=name)
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise RequestError("metadata must be an object", param="metadata")
    runner = runner_of(request)
    batch = runner.create(body["input_file_id"], body["endpoint"], body["completion_window"], metadata)
    return JSONResponse(batch)


@router.get("/v1/batches")
async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> dict:
    batches = [public(b) for b in runner_of(request).batches.list()]
    if after is not None:
        ids = [b["id"] for b in batches]
        batches = batches[ids.index(after) + 1 :] if after in ids else []
    page = batches[: max(1, min(limit, 100))]
    first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
    return {"object": "list", "data": page, "has_more": len(batches) > len(page), "first_id": first,
            "last_id": last}  # fmt: skip


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(request: Request, batch_id: str) -> Response:
    batch = runner_of(request).batches.get(batch_id)
    return JSONResponse(public(batch)) if batch is not None else _not_found(batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> Response:
    batch = runner_of(request).cancel(batch_id)
    return JSONResponse(batch) if batch is not None else _not_found(batch_id)


def _not_found(batch_id: str) -> Response:
    return error_response(f"No such batch: {batch_id}", 404, param="batch_id")
