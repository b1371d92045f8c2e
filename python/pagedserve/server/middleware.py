"""ASGI middleware: the API key, the Host header check, and the request body's
size and time limits.

All are plain ASGI (not Starlette's BaseHTTPMiddleware), which would sit
between a streaming response and the client and hide disconnects.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from typing import Awaitable, Callable, Iterable, Optional

from pagedserve.server.errors import ErrorResponse, error_body

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Paths that need the API key when one is set; /health, /metrics and the page stay open, as in vLLM.
# The docs describe the whole API, so they are behind the key too.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/docs", "/redoc", "/openapi.json")
METHODS_WITH_BODY = ("POST", "PUT", "PATCH")
# Host names every server answers without a key: the loopback names.
LOCAL_HOST_NAMES = ("localhost",)


def _header(scope: Scope, name: bytes) -> Optional[bytes]:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


async def _reject(scope: Scope, receive: Receive, send: Send, status: int, message: str,
                  code: Optional[str] = None, headers: Optional[dict] = None) -> None:
    await ErrorResponse(error_body(status, message, code=code), status_code=status, headers=headers)(
        scope, receive, send)


def bearer_token(authorization: Optional[bytes]) -> Optional[bytes]:
    """The token of an 'Authorization: Bearer TOKEN' header (the scheme in any case), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip()


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES) and scope["method"] != "OPTIONS":
            given = bearer_token(_header(scope, b"authorization"))
            if given is None or not hmac.compare_digest(given, self._expected):
                await _reject(scope, receive, send, 401, "missing or incorrect API key: send the header "
                              "'Authorization: Bearer <key>'", code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})
                return
        await self.app(scope, receive, send)


def host_name(host_header: bytes) -> str:
    """The name part of a Host header value ('[::1]:8000' -> '::1', 'Example.com.' -> 'example.com')."""
    text = host_header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    if text.count(":") == 1:
        text = text.split(":", 1)[0]
    return text.rstrip(".")


def _is_ip_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class HostCheckMiddleware:
    """Answers only requests whose Host header is a loopback name, an IP address, the bound host or an
    allowed name (a server without an API key). A page of another site that rebinds its DNS name to
    127.0.0.1 sends its own name as Host, so it cannot read this server's answers."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str]):
        self.app = app
        self._allowed = {name.lower().rstrip(".") for name in allowed}

    def allows(self, host_header: Optional[bytes]) -> bool:
        if host_header is None:  # HTTP/1.0 without Host: not a browser
            return True
        name = host_name(host_header)
        return (name in self._allowed or name in LOCAL_HOST_NAMES or name.endswith(".localhost")
                or _is_ip_address(name))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = _header(scope, b"host")
            if not self.allows(host):
                shown = host.decode("latin-1")[:100] if host else ""
                await _reject(scope, receive, send, 400, f"the Host header {shown!r} is not one this server "
                              "answers: without --api-key it answers localhost, IP addresses, --host and "
                              "--allowed-hosts only", code="host_not_allowed")
                return
        await self.app(scope, receive, send)


def parse_allowed_hosts(value: Optional[str], bound_host: str) -> Optional[set[str]]:
    """The --allowed-hosts set plus the bound host name; None when any host is allowed ('*')."""
    names = {n.strip() for n in (value or "").split(",") if n.strip()}
    if "*" in names:
        return None
    if bound_host and bound_host not in ("0.0.0.0", "::"):
        names.add(bound_host)
    return names


class BodyLimitMiddleware:
    """Reads a request body up to `max_bytes` before the app sees it (413 beyond) and within
    `timeout_s` (408 after, and the connection closes), then replays it; later receive() calls go
    to the server, so disconnects still arrive."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = 30.0):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

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
        try:
            body, early = await asyncio.wait_for(self._read_body(receive), self.timeout_s)
        except asyncio.TimeoutError:
            await _reject(scope, receive, send, 408, f"the request body did not arrive within {self.timeout_s:g} s "
                          "(--timeout-body)", code="request_timeout", headers={"Connection": "close"})
            return
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
