"""Running /v1/batches: each batch's input lines (OpenAI's batch format: `custom_id`, `method`,
`url`, `body`) answered through the chat / completions logic, at most `--batch-max-running`
lines of all batches together in the engine at once, each a batch line that yields to
interactive requests (managers/req.py); every answer appended to the batch's result log as it
comes. At the end the logs become the output file (status 200) and the error
file (refusals, and malformed lines found before the run). A restarted server resumes every
unfinished batch and skips the custom_ids its logs already hold: each line is answered once. A
line in the engine when the scheduler died runs again once a new scheduler is up."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from radixengine.entrypoints.batch_store import TERMINAL, BatchStore, ResultLog, public
from radixengine.entrypoints.file_store import FileStore
from radixengine.entrypoints.openai_routes import answer_body
from radixengine.managers.request_errors import EngineDeadError, RequestError, SchedulerRestartError
from radixengine.managers.tokenizer_manager import TokenizerManager
from radixengine.utils.jsonl import decode_line, numbered_lines

logger = logging.getLogger(__name__)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOW_S = 24 * 3600
RESTART_POLL_S = 0.2  # how often a line waiting for a new scheduler looks again


def req_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


@dataclass
class Line:
    index: int
    custom_id: str | None
    body: dict | None = None
    error: str | None = None  # why the line is malformed


def parse_lines(data: bytes, endpoint: str) -> list[Line]:
    """The input file's non-empty lines; a malformed one (not UTF-8, not a JSON object, no custom_id,
    another method or url, no body object, a custom_id seen before) carries its reason."""
    lines: list[Line] = []
    seen: set[str] = set()
    for n, raw in numbered_lines(data.split(b"\n")):
        lines.append(_parse_line(n, raw, endpoint, seen))
    return lines


def _parse_line(n: int, raw: bytes, endpoint: str, seen: set[str]) -> Line:
    try:
        text = decode_line(raw)
    except ValueError as e:
        return Line(n, None, error=f"line {n}: {e}")
    try:
        obj = json.loads(text)
    except ValueError as e:
        return Line(n, None, error=f"line {n}: invalid JSON: {e}")
    if not isinstance(obj, dict):
        return Line(n, None, error=f"line {n}: not a JSON object")
    cid = obj.get("custom_id")
    why = None
    if not isinstance(cid, str) or not cid:
        cid, why = None, "custom_id must be a non-empty string"
    elif cid in seen:
        why = f"custom_id {cid!r} is not unique in the file"
    elif obj.get("method", "POST") != "POST":
        why = f"method must be POST, got {obj.get('method')!r}"
    elif obj.get("url") != endpoint:
        why = f"url must be the batch's endpoint {endpoint}, got {obj.get('url')!r}"
    elif not isinstance(obj.get("body"), dict):
        why = "body must be a JSON object"
    if why is not None:
        return Line(n, cid, error=f"line {n}: {why}")
    seen.add(cid)
    return Line(n, cid, obj["body"])


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in numbered_lines(f))


class BatchRunner:
    def __init__(self, tm: TokenizerManager, files: FileStore, batches: BatchStore, server_args) -> None:
        self.tm = tm
        self.files = files
        self.batches = batches
        self.max_lines = server_args.max_batch_lines
        self.max_running = server_args.batch_max_running
        self.slots = asyncio.Semaphore(self.max_running)  # lines of all batches in the engine at once
        self.tasks: dict[str, asyncio.Task] = {}
        self.live: dict[str, dict] = {}  # the Batch objects of the running batches
        self.stopping = False

    # Lifecycle --------------------------------------------------------------------------------

    def resume_all(self) -> None:
        for batch in self.batches.list():
            if batch["status"] not in TERMINAL:
                logger.info("resuming batch %s (%s)", batch["id"], batch["status"])
                self._start(batch["id"])

    async def stop(self) -> None:
        """Server shutdown: the runs stop where they are; a restart resumes them."""
        self.stopping = True
        for task in self.tasks.values():
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks.values())

    def _start(self, batch_id: str) -> None:
        self.tasks[batch_id] = asyncio.ensure_future(self._run(batch_id))

    # API --------------------------------------------------------------------------------------

    def create(
        self, input_file_id: str, endpoint: str, completion_window: str, metadata: dict | None
    ) -> dict:
        if endpoint not in ENDPOINTS:
            raise RequestError(
                f"endpoint must be one of {', '.join(ENDPOINTS)}; got {endpoint!r}", param="endpoint"
            )
        if completion_window != "24h":
            raise RequestError("completion_window must be 24h", param="completion_window")
        meta = self.files.get(input_file_id)
        if meta is None:
            raise RequestError(f"No file with id {input_file_id!r}", param="input_file_id")
        if meta["purpose"] != "batch":
            raise RequestError(f"File {input_file_id} has purpose {meta['purpose']!r}, not 'batch'",
                               param="input_file_id")  # fmt: skip
        total = count_lines(self.files.data_path(input_file_id))
        if total > self.max_lines:
            raise RequestError(f"The input file has {total} lines; at most {self.max_lines} (--max-batch-lines)",
                               param="input_file_id")  # fmt: skip
        now = int(time.time())
        batch = {
            "id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + COMPLETION_WINDOW_S, "finalizing_at": None, "completed_at": None,
            "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": total, "completed": 0, "failed": 0}, "metadata": metadata,
        }  # fmt: skip
        self.batches.save(batch)
        self._start(batch["id"])
        return public(batch)

    def cancel(self, batch_id: str) -> dict | None:
        batch = self.live.get(batch_id) or self.batches.get(batch_id)
        if batch is None:
            return None
        if batch["status"] in (*TERMINAL, "cancelling", "finalizing"):
            return public(batch)
        batch.update(status="cancelling", cancelling_at=int(time.time()))
        self.batches.save(batch)
        task = self.tasks.get(batch_id)
        if batch_id in self.live:  # a run holds it (a run leaves `live` whatever way it ends)
            task.cancel()  # its lines in the engine are aborted; the run finishes it as cancelled
        elif task is None or task.done():
            self._start(batch_id)  # (a run not started yet reads the cancel from disk)
        return public(batch)

    # A run ------------------------------------------------------------------------------------

    async def _run(self, batch_id: str) -> None:
        """One run of a batch, to its end: a terminal status, or (the server stopping, the engine
        down) left unfinished for a restart to resume. Whatever else fails ends it `failed`."""
        batch = self.batches.get(batch_id)
        if batch is None:
            logger.error("batch %s: its Batch object cannot be read; it does not run", batch_id)
            self.tasks.pop(batch_id, None)
            return
        self.live[batch_id] = batch
        logs: dict[str, ResultLog] = {}
        try:
            self._finish(batch, await self._run_lines(batch, logs))
        except EngineDeadError:
            logger.warning("batch %s stopped: the engine is down; a restart resumes it", batch_id)
        except Exception as e:
            logger.exception("batch %s failed", batch_id)
            self._fail(batch, f"the batch's run failed: {_reason(e)}")
        finally:
            for log in logs.values():
                log.close()
            self.tasks.pop(batch_id, None)
            self.live.pop(batch_id, None)

    async def _run_lines(self, batch: dict, logs: dict[str, ResultLog]) -> str:
        """Open the result logs (into `logs`) and answer the lines not in them yet; returns the
        status the batch ends with. A cancel (not the server's stop) ends it `cancelled`."""
        try:
            for kind in ("output", "error", "invalid"):
                logs[kind] = ResultLog(self.batches.log_path(batch["id"], kind))
            if batch["status"] in ("validating", "in_progress"):
                await self._answer_all(batch, logs)
        except asyncio.CancelledError:
            if self.stopping or batch["status"] != "cancelling":
                raise
        return "cancelled" if batch["status"] == "cancelling" else "completed"

    async def _answer_all(self, batch: dict, logs: dict[str, ResultLog]) -> None:
        lines = parse_lines(self.files.data_path(batch["input_file_id"]).read_bytes(), batch["endpoint"])
        if batch["status"] == "validating":  # malformed lines go to the invalid log, once
            logs["invalid"].reset()
            for line in lines:
                if line.error is not None:
                    logs["invalid"].append(_error_line(line, line.error))
            batch.update(status="in_progress", in_progress_at=int(time.time()))
        done = logs["output"].custom_ids | logs["error"].custom_ids
        pending = iter([line for line in lines if line.error is None and line.custom_id not in done])
        self._count(batch, logs)

        async def worker() -> None:
            for line in pending:
                async with self.slots:
                    await self._answer(batch, line, logs)

        workers = [asyncio.ensure_future(worker()) for _ in range(self.max_running)]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.wait(workers)

    async def _answer(self, batch: dict, line: Line, logs: dict[str, ResultLog]) -> None:
        """Run one line: its answer (or the refusal, or an internal error) appended to the output
        or error log. The one place a line runs; an engine that went down stops the batch."""
        rid = req_id()
        try:
            body = await self._answer_through_restarts(batch, line)
            logs["output"].append(_response_line(line, rid, 200, body))
        except RequestError as e:
            error = {
                "error": {"message": e.message, "type": e.err_type, "param": e.param, "code": e.status_code}
            }
            logs["error"].append(_response_line(line, rid, e.status_code, error))
        except EngineDeadError:
            raise
        except Exception as e:  # a bug: this line fails, the batch goes on
            logger.exception("batch %s, line %d", batch["id"], line.index)
            error = {"error": {"message": f"internal error: {e}", "type": "InternalServerError", "param": None,
                               "code": 500}}  # fmt: skip
            logs["error"].append(_response_line(line, rid, 500, error))
        self._count(batch, logs)

    async def _answer_through_restarts(self, batch: dict, line: Line) -> dict:
        """The line's answer; a line that failed because the scheduler died and is restarting
        runs again on the new one (nothing of it was logged)."""
        while True:
            try:
                return await answer_body(self.tm, batch["endpoint"], line.body, interactive=False)
            except SchedulerRestartError:
                logger.warning(
                    "batch %s, line %d: the scheduler restarted; running it again", batch["id"], line.index
                )
                while self.tm.restarting:
                    await asyncio.sleep(RESTART_POLL_S)

    def _count(self, batch: dict, logs: dict[str, ResultLog]) -> None:
        failed = logs["error"].count + logs["invalid"].count
        batch["request_counts"].update(completed=logs["output"].count, failed=failed)
        self.batches.save(batch)

    def _finish(self, batch: dict, status: str) -> None:
        """The logs become the output file and the error file (malformed lines first); the batch
        ends `status`. Each step can be done again: a kill in between finishes on restart."""
        if batch["status"] != "finalizing":
            ids = {"output": self.files.new_id(), "error": self.files.new_id()}
            batch.update(status="finalizing", finalizing_at=int(time.time()), _final=status, _file_ids=ids)
            self.batches.save(batch)
        paths = {kind: self.batches.log_path(batch["id"], kind) for kind in ("output", "error", "invalid")}
        sources = {"output": ["output"], "error": ["invalid", "error"]}
        for kind, names in sources.items():
            data = b"".join(paths[n].read_bytes() for n in names if paths[n].exists())
            if data:
                file_id = batch["_file_ids"][kind]
                self.files.write(file_id, data, f"{batch['id']}_{kind}.jsonl", f"batch_{kind}")
                batch[f"{kind}_file_id"] = file_id
        final = batch.pop("_final")
        batch.pop("_file_ids")
        batch.update(status=final, **{f"{final}_at": int(time.time())})
        self.batches.save(batch)
        for path in paths.values():
            path.unlink(missing_ok=True)
        logger.info("batch %s %s: %s", batch["id"], final, batch["request_counts"])

    def _fail(self, batch: dict, message: str) -> None:
        """The batch ends `failed`, `message` in its `errors`, the results so far in its files
        (without them when even that fails)."""
        error = {"code": "batch_failed", "message": message, "param": None, "line": None}
        batch["errors"] = {"object": "list", "data": [error]}
        if batch["status"] == "finalizing":
            batch["_final"] = "failed"
        try:
            self._finish(batch, "failed")
        except Exception:
            logger.exception("batch %s: its results cannot be written to files", batch["id"])
            for key in ("_final", "_file_ids"):
                batch.pop(key, None)
            batch.update(status="failed", failed_at=int(time.time()))
            self.batches.save(batch)


def _reason(e: Exception) -> str:
    """What failed, naming a file of the batch folder by its name only."""
    if isinstance(e, OSError) and e.filename is not None:
        return f"{type(e).__name__}: {e.strerror}: {Path(e.filename).name}"
    return f"{type(e).__name__}: {e}"


def _response_line(line: Line, rid: str, status_code: int, body: dict) -> dict:
    response = {"status_code": status_code, "request_id": rid, "body": body}
    return {"id": rid, "custom_id": line.custom_id, "response": response, "error": None}


def _error_line(line: Line, message: str) -> dict:
    return {"id": req_id(), "custom_id": line.custom_id, "response": None,
            "error": {"code": "invalid_request", "message": message}}  # fmt: skip
