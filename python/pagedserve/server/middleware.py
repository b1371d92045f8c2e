"""ASGI middleware: API-key checks and the request-body size limit.

Both are plain ASGI (not Starlette's BaseHTTPMiddleware), which would sit
between a streaming response and the client and hide disconnects.
"""

from __future__ import annotations

import hmac
from typing import Awaitable, Callable, Optional

from fastapi.responses import JSONResponse

from pagedserve.server.errors import error_body

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Paths that need the API key when one is set; /health, /metrics and the page stay open, as in vLLM.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
METHODS_WITH_BODY = ("POST", "PUT", "PATCH")


def _header(scope: Scope, name: bytes) -> Optional[bytes]:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


async def _reject(scope: Scope, receive: Receive, send: Send, status: int, message: str,
                  code: Optional[str] = None, headers: Optional[dict] = None) -> None:
    await JSONResponse(error_body(status, message, code=code), status_code=status, headers=headers)(
        scope, receive, send)


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES) and scope["method"] != "OPTIONS":
            given = _header(scope, b"authorization") or b""
            if not hmac.compare_digest(given, self._expected):
                await _reject(scope, receive, send, 401, "missing or incorrect API key: send the header "
                              "'Authorization: Bearer <key>'", code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads a request body up to `max_bytes` before the app sees it (413 beyond), then
    replays it; later receive() calls go to the server, so disconnects still arrive."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in METHODS_WITH_BODY:
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await _reject(scope, receive, send, 400, "the Content-Length header is not a number")
                return
            if int(declared) > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
        body, early = await self._read_body(receive)
        if body is None:
            await self._too_large(scope, receive, send)
            return
        await self.app(scope, _replay(body, early, receive), send)

    async def _read_body(self, receive: Receive) -> tuple[Optional[bytes], Optional[Message]]:
        """(body, a disconnect that came while reading); body None once it outgrew the limit."""
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks), message
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                return None, None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _reject(scope, receive, send, 413, f"the request body is larger than this server accepts "
                      f"({self.max_bytes} bytes, --max-request-bytes)", code="request_too_large")


def _replay(body: bytes, early: Optional[Message], receive: Receive) -> Receive:
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    if early is not None:
        pending.append(early)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()
    return replayed
