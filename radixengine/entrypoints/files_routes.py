"""OpenAI's Files API for batches: POST /v1/files (a multipart upload, `purpose: batch`), GET
/v1/files (list), GET / DELETE /v1/files/{id}, GET /v1/files/{id}/content. The files live in
the batch folder (`--batch-dir`), so they survive a restart."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser

from radixengine.entrypoints.batch_runner import BatchRunner, count_lines
from radixengine.entrypoints.batch_store import TERMINAL
from radixengine.entrypoints.http_errors import error_response
from radixengine.managers.request_errors import RequestError

router = APIRouter()
PURPOSES = ("batch",)
CHUNK = 1 << 20
MAX_LIST = 10000  # OpenAI's most files in one page of GET /v1/files (and its default)


def runner_of(request: Request) -> BatchRunner:
    runner = request.app.state.batch_runner
    if runner is None:
        raise RequestError("/v1/files and /v1/batches are off: another server uses this --batch-dir, or it "
                           "cannot be created (the server's log says which)", status_code=503)  # fmt: skip
    return runner


@router.post("/v1/files")
async def upload_file(request: Request) -> Response:
    runner = runner_of(request)
    limit = runner.tm.server_args.max_batch_file_bytes
    body_limit = limit + CHUNK  # the form's own bytes aside
    if int(request.headers.get("content-length") or 0) > body_limit:
        return _too_large(limit)
    try:
        form = await read_form(request, body_limit)
    except BodyTooLarge:
        return _too_large(limit)
    try:
        return await _store_upload(runner, form, limit)
    finally:
        await form.close()


class BodyTooLarge(MultiPartException):
    """(A MultiPartException: the parser then closes the files it opened.)"""


async def read_form(request: Request, max_bytes: int) -> FormData:
    """The multipart form of the request, reading no more than `max_bytes` of its body (a chunked
    upload has no Content-Length to refuse it by): BodyTooLarge past that. Another content type
    is an empty form."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        return FormData()

    async def bounded() -> AsyncIterator[bytes]:
        received = 0
        async for chunk in request.stream():
            received += len(chunk)
            if received > max_bytes:
                raise BodyTooLarge(f"more than {max_bytes} bytes")
            yield chunk

    try:
        return await MultiPartParser(request.headers, bounded()).parse()
    except BodyTooLarge:
        raise
    except MultiPartException as e:
        raise RequestError(f"the body is not a valid multipart form: {e.message}", param="file") from None


async def _store_upload(runner: BatchRunner, form: FormData, limit: int) -> Response:
    upload, purpose = form.get("file"), form.get("purpose")
    if purpose not in PURPOSES:
        raise RequestError(f"purpose must be one of {', '.join(PURPOSES)}; got {purpose!r}", param="purpose")
    if upload is None or isinstance(upload, str):
        raise RequestError("file is required (a multipart file part)", param="file")
    files = runner.files
    file_id = files.new_id()
    tmp = files.root / f"{file_id}.upload"
    size = 0
    with open(tmp, "wb") as out:
        while chunk := await upload.read(CHUNK):
            size += len(chunk)
            if size > limit:
                break
            out.write(chunk)
    if size > limit:
        tmp.unlink()
        return _too_large(limit)
    lines = count_lines(tmp)
    if lines > runner.max_lines or lines == 0:
        tmp.unlink()
        why = "has no request line" if lines == 0 else f"has {lines} lines; at most {runner.max_lines}"
        raise RequestError(f"The file {why} (--max-batch-lines)", param="file")
    return JSONResponse(files.add(file_id, tmp, upload.filename or "upload.jsonl", purpose))


def _too_large(limit: int) -> Response:
    """OpenAI answers a batch file over its size limit with a 400 (`File is too large.`)."""
    return error_response(
        f"File is too large: more than {limit} bytes (--max-batch-file-bytes)", 400, param="file"
    )


@router.get("/v1/files")
async def list_files(
    request: Request, purpose: str | None = None, limit: str = str(MAX_LIST), after: str | None = None,
    order: str = "desc",
) -> dict:  # fmt: skip
    """OpenAI's cursor page: by `created_at` (`order` desc or asc), from the file after `after`,
    at most `limit` (1..10000, default 10000)."""
    if not (limit.isdigit() and 1 <= int(limit) <= MAX_LIST):
        raise RequestError(f"limit must be an integer from 1 to {MAX_LIST}, got {limit!r}", param="limit")
    if order not in ("asc", "desc"):
        raise RequestError(f"order must be asc or desc, got {order!r}", param="order")
    files = runner_of(request).files.list(purpose)  # newest first
    if order == "asc":
        files.reverse()
    if after is not None:
        ids = [f["id"] for f in files]
        files = files[ids.index(after) + 1 :] if after in ids else []
    page = files[: int(limit)]
    first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
    return {"object": "list", "data": page, "has_more": len(files) > len(page), "first_id": first,
            "last_id": last}  # fmt: skip


@router.get("/v1/files/{file_id}")
async def retrieve_file(request: Request, file_id: str) -> Response:
    meta = runner_of(request).files.get(file_id)
    return JSONResponse(meta) if meta is not None else _not_found(file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> Response:
    files = runner_of(request).files
    if files.get(file_id) is None:
        return _not_found(file_id)
    return FileResponse(files.data_path(file_id), media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> Response:
    runner = runner_of(request)
    users = [
        b["id"]
        for b in runner.batches.list()
        if b["input_file_id"] == file_id and b["status"] not in TERMINAL
    ]
    if users:
        raise RequestError(f"File {file_id} is the input of the unfinished batch {users[0]}", param="file_id")
    if not runner.files.delete(file_id):
        return _not_found(file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


def _not_found(file_id: str) -> Response:
    return error_response(f"No such File object: {file_id}", 404, param="file_id")
