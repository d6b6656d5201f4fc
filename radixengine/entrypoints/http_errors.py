"""The HTTP error body, OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from fastapi.responses import JSONResponse


def error_response(
    message: str, status_code: int = 400, param: str | None = None, err_type: str | None = None
) -> JSONResponse:
    if err_type is None:
        err_type = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}.get(
            status_code, "ServiceUnavailableError" if status_code == 503 else "InternalServerError"
        )
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status_code}}
    return JSONResponse(body, status_code=status_code)
