"""The HTTP error body, OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from radixengine.managers.request_errors import error_type


def error_response(
    message: str, status_code: int = 400, param: str | None = None, err_type: str | None = None
) -> JSONResponse:
    err_type = err_type or error_type(status_code)
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status_code}}
    return JSONResponse(body, status_code=status_code)
