"""Sockets and connections: binding the port before anything is announced, and
keeping slow or numerous clients from taking the server down.

- bind_socket() holds the port (or says in one line why it cannot).
- GuardedH11Protocol is uvicorn's HTTP/1.1 protocol with a header timeout
  (uvicorn times out idle keep-alive connections, but not a connection that
  sends half a request line and waits) and a cap on open connections.
- RateLimitedLog and the event loop's exception handler keep a flood (accept
  failing with EMFILE, thousands of bad requests) to a line every few seconds.
The body's own timeout is BodyLimitMiddleware's (middleware.py).
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import time
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("pagedserve.server")

# Seconds between two log lines about the same kind of flood.
FLOOD_LOG_INTERVAL_S = 10.0
RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class BindError(Exception):
    """The port cannot be held; the message is one line for the user."""


def bind_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening socket on host:port (port 0: any free one). Raises BindError."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise BindError(f"cannot resolve --host {host!r}: {err.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
        sock.bind(address)
        sock.listen(backlog)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise BindError(f"port {port} on {host} is in use (is another server running?); stop it or pick "
                            f"another port with --port") from None
        if err.errno == errno.EACCES:
            raise BindError(f"no permission to bind port {port} on {host} (ports below 1024 need "
                            f"privileges); pick another with --port") from None
        if err.errno == errno.EADDRNOTAVAIL:
            raise BindError(f"address {host} is not one of this machine's; pick another with --host") from None
        raise BindError(f"cannot bind {host}:{port}: {err.strerror}") from None
    sock.set_inheritable(True)
    return sock


def raise_open_file_limit(wanted: int = 65536) -> None:
    """Lifts the soft open-file limit toward the hard one (as vLLM does): each connection is a
    descriptor, and a soft limit of 1024 is below --max-connections' default plus the server's own."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):  # not POSIX, or not allowed: keep the limit there is
        pass


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class RateLimitedLog:
    """Logs a kind of event at most once per `interval_s`, saying how many went unlogged."""

    def __init__(self, log: logging.Logger = logger, interval_s: float = FLOOD_LOG_INTERVAL_S):
        self._log = log
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def allow(self, key: str) -> Optional[int]:
        """None to stay silent; otherwise how many were suppressed since the last line."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._suppressed.pop(key, 0)

    def warning(self, key: str, message: str) -> None:
        suppressed = self.allow(key)
        if suppressed is not None:
            more = f" ({suppressed} more like it in the last {self.interval_s:g} s)" if suppressed else ""
            self._log.warning("%s%s", message, more)


class RateLimitFilter(logging.Filter):
    """For uvicorn's logger: the same message template at most once per interval."""

    def __init__(self, interval_s: float = FLOOD_LOG_INTERVAL_S):
        super().__init__()
        self._limit = RateLimitedLog(interval_s=interval_s)

    def filter(self, record: logging.LogRecord) -> bool:
        suppressed = self._limit.allow(str(record.msg))
        if suppressed is None:
            return False
        if suppressed:
            record.msg = f"{record.msg} ({suppressed} more like it in the last {self._limit.interval_s:g} s)"
        return True


def loop_exception_handler(flood: RateLimitedLog):
    """An asyncio exception handler: running out of file descriptors (accept fails with EMFILE; asyncio
    retries every second) gives one line per interval and no traceback; other errors keep asyncio's
    own report, each kind at most once per interval."""

    def handle(loop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS:
            flood.warning(f"resource:{exc.errno}", f"cannot accept connections: {exc.strerror} (the open-file "
                          f"limit, `ulimit -n`, is too low for the connections open; see --max-connections)")
            return
        if flood.allow(f"loop:{context.get('message')}") is not None:
            loop.default_exception_handler(context)
    return handle


def _raw_response(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    body = json.dumps({"error": {"message": message, "type": "service_unavailable_error" if status == 503 else
                                 "invalid_request_error", "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n{extra}"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode("ascii") + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a header timeout and a connection cap; configure() makes a
    subclass with the limits (uvicorn builds protocols from a class)."""

    header_timeout_s: float = 10.0
    max_connections: Optional[int] = None
    flood: RateLimitedLog = RateLimitedLog()

    @classmethod
    def configure(cls, header_timeout_s: float, max_connections: Optional[int],
                  flood: Optional[RateLimitedLog] = None) -> type["GuardedH11Protocol"]:
        return type("GuardedH11Protocol", (cls,), {"header_timeout_s": header_timeout_s,
                                                    "max_connections": max_connections,
                                                    "flood": flood or RateLimitedLog()})

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._header_timer = None
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            self.flood.warning("connections", f"refusing connections: {self.max_connections} are open "
                               f"(--max-connections)")
            transport.write(_raw_response(503, "Service Unavailable", "the server has too many open connections; "
                                          "retry later", "too_many_connections", "retry-after: 1\r\n"))
            transport.close()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self._header_timer is not None and self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()  # the request line and headers are in

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()  # for the next request on this connection

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served: its body has a timeout of its own
        if self.conn.trailing_data[0]:  # half a request came: say why it ends
            self.transport.write(_raw_response(408, "Request Timeout", f"the request headers did not arrive "
                                               f"within {self.header_timeout_s:g} s (--timeout-header)",
                                               "request_timeout"))
        self.transport.close()
