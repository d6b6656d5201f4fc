"""`--api-key`, as SGLang checks it: every route needs `Authorization: Bearer <key>` (the scheme in
any case, the key compared in constant time) but the probes — paths under /health and /metrics —
and CORS preflights (OPTIONS). A plain ASGI middleware, so that disconnect detection and
streaming pass through untouched."""

from __future__ import annotations

import hmac

from radixengine.entrypoints.http_errors import error_response

OPEN_PREFIXES = ("/health", "/metrics")


def bearer_token(scope) -> bytes | None:
    header = dict(scope["headers"]).get(b"authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


class APIKeyMiddleware:
    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and not self.allowed(scope):
            response = error_response("invalid or missing API key (Authorization: Bearer ...)", 401)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def allowed(self, scope) -> bool:
        if scope["method"] == "OPTIONS" or scope["path"].startswith(OPEN_PREFIXES):
            return True
        token = bearer_token(scope)
        return token is not None and hmac.compare_digest(token, self.expected)
