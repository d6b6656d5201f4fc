"""OpenAI's Files API for batches: POST /v1/files (a multipart upload, `purpose: batch`), GET
/v1/files (list), GET / DELETE /v1/files/{id}, GET /v1/files/{id}/content. The files live in
the batch folder (`--batch-dir`), so they survive a restart."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from radixengine.entrypoints.batch_runner import BatchRunner, count_lines
from radixengine.entrypoints.batch_store import TERMINAL
from radixengine.entrypoints.http_errors import error_response
from radixengine.managers.request_errors import RequestError

router = APIRouter()
PURPOSES = ("batch",)
CHUNK = 1 << 20


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
    if int(request.headers.get("content-length") or 0) > limit + CHUNK:  # the form's own bytes aside
        return _too_large(limit)
    form = await request.form()
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
    return error_response(
        f"The file is larger than {limit} bytes (--max-batch-file-bytes)", 413, param="file"
    )


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None) -> dict:
    data = runner_of(request).files.list(purpose)
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "has_more": False, "first_id": first, "last_id": last}


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
