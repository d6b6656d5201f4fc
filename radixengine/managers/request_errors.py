"""How a request fails on the front end: `RequestError` (refused or aborted, with its HTTP status)
and `EngineDeadError` (a child process died), and the abort finish reason read back as an error."""

from __future__ import annotations


class RequestError(Exception):
    """A request the engine refused or aborted (bad input, full queue, ...), with its HTTP status."""

    def __init__(
        self, message: str, status_code: int = 400, param: str | None = None, err_type: str | None = None
    ):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.err_type = err_type or ("BadRequestError" if status_code < 500 else "ServiceUnavailableError")


class EngineDeadError(RuntimeError):
    """A child process of the engine died; the engine cannot serve any more requests."""


def is_abort(out: dict) -> bool:
    reason = out["meta_info"].get("finish_reason")
    return bool(reason) and reason.get("type") == "abort"


def abort_to_error(out: dict) -> RequestError:
    reason = out["meta_info"]["finish_reason"]
    return RequestError(
        reason.get("message", "request aborted"),
        reason.get("status_code", 400),
        param=reason.get("param"),
        err_type=reason.get("err_type"),
    )
