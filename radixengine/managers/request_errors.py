"""How a request fails on the front end: `RequestError` (refused or aborted, with its HTTP status)
and `EngineDeadError` (a child process died), and the abort finish reason read back as an error."""

from __future__ import annotations

import re
from http import HTTPStatus

from radixengine.managers.generate_output import GenerateOutput

# The `type` of an error body, by HTTP status: the openai client's exception names where it has
# one for the status, else the status phrase (`405` -> `MethodNotAllowedError`).
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}


def error_type(status_code: int) -> str:
    """The error `type` of an HTTP status: 5xx other than 503 are `InternalServerError`, an
    unnamed 4xx is `BadRequestError`."""
    if status_code in ERROR_TYPES:
        return ERROR_TYPES[status_code]
    if status_code >= 500:
        return "InternalServerError"
    try:
        phrase = HTTPStatus(status_code).phrase
    except ValueError:
        return "BadRequestError"
    return "".join(word.capitalize() for word in re.split(r"[^A-Za-z]+", phrase)) + "Error"


class RequestError(Exception):
    """A request the engine refused or aborted (bad input, full queue, ...), with its HTTP status."""

    def __init__(
        self, message: str, status_code: int = 400, param: str | None = None, err_type: str | None = None
    ):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.err_type = err_type or error_type(status_code)


class EngineDeadError(RuntimeError):
    """A child process of the engine died; the engine cannot serve any more requests."""


class SchedulerRestartError(EngineDeadError):
    """The scheduler died and a new one is starting: this request failed (or was refused while
    the new one starts); the same request can be sent again once /health answers 200."""


def is_abort(out: GenerateOutput) -> bool:
    reason = out["meta_info"].get("finish_reason")
    return bool(reason) and reason.get("type") == "abort"


ABORT_REQUESTED_STATUS = 499  # /abort_request, or the client gone (Req.to_abort_status_code)


def is_requested_abort(out: GenerateOutput) -> bool:
    """An abort someone asked for (not a refusal): SGLang's native API answers it as a normal
    output whose finish_reason is the abort."""
    return is_abort(out) and out["meta_info"]["finish_reason"].get("status_code") == ABORT_REQUESTED_STATUS


def abort_to_error(out: GenerateOutput) -> RequestError:
    reason = out["meta_info"]["finish_reason"]
    return RequestError(
        reason.get("message", "request aborted"),
        reason.get("status_code", 400),
        param=reason.get("param"),
        err_type=reason.get("err_type"),
    )
