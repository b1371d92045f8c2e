"""Hostile and careless clients against a real server process (over the fake
engine, so it starts in a second): slow headers and bodies time out, a
connection cap answers 503, running out of file descriptors logs a line
rather than a flood, and a bad request never costs the keep-alive connection.
Every test uses a bounded number of raw sockets on 127.0.0.1."""

from __future__ import annotations

import re
import socket
import time

import httpx
import pytest

from fake_engine import CRASH, SECRET
from server_process import ServerProcess

NUM_SLOW_CLIENTS = 200
TIMEOUT_S = 2


def connect(server: ServerProcess, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    if data:
        sock.sendall(data)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one HTTP/1.1 response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {data!r}")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def request(method: str, path: str, body: bytes = b"", port: int = 0) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def closed_by_server(sock: socket.socket) -> bytes:
    """What the server sent before closing (b"" for a silent close); raises if it stays open."""
    sock.settimeout(10)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--timeout-header", str(TIMEOUT_S), "--timeout-body", str(TIMEOUT_S), "--fake-step-seconds",
                       "0.002", fake=True) as s:
        yield s


def test_slow_headers_and_bodies_time_out_while_health_answers(server):
    half_header = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
    half_body = request("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": 2}', server.port)[:-10]
    socks = [connect(server, half_header if i % 2 else half_body) for i in range(NUM_SLOW_CLIENTS)]
    try:
        started = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - started < TIMEOUT_S
        answers = [closed_by_server(s) for s in socks]
    finally:
        for s in socks:
            s.close()
    assert time.monotonic() - started < TIMEOUT_S + 8
    # each slow client is told why (408) and the connection ends
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), {a[:40] for a in answers}
    assert b"--timeout-header" in answers[1] and b"--timeout-body" in answers[0]
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_an_idle_connection_that_never_sends_is_closed(server):
    sock = connect(server)
    try:
        started = time.monotonic()
        assert closed_by_server(sock) == b""
        assert TIMEOUT_S - 0.5 < time.monotonic() - started < TIMEOUT_S + 5
    finally:
        sock.close()


def test_a_bad_request_keeps_the_keep_alive_connection(server):
    sock = connect(server)
    try:
        for body, status in ((b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400),
                             (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400),
                             (f'{{"prompt": "{CRASH}", "max_tokens": 2}}'.encode(), 500),
                             (b'{"prompt": "fine", "max_tokens": 2}', 200)):
            path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
            sock.sendall(request("POST", path, body, server.port))
            got, headers, payload = read_response(sock)
            assert got == status, payload
            assert headers.get("connection") != "close" and SECRET.encode() not in payload
        sock.sendall(request("POST", "/tokenize", b'{"prompt": "a\\udfffb"}', server.port))
        assert read_response(sock)[0] == 400
        sock.sendall(request("GET", "/health", port=server.port))
        assert read_response(sock)[0] == 200
    finally:
        sock.close()
    log = server.log(None)
    # the 500 is logged once, with its traceback, under the id the client got; the 400s not at all
    assert log.count("Traceback") == 1 and SECRET in log
    assert "surrogate" not in log and "UnicodeEncodeError" not in log


def test_the_connection_cap_answers_503_and_frees_at_once():
    with ServerProcess("--max-connections", "20", fake=True) as server:
        socks = [connect(server) for _ in range(30)]
        try:
            time.sleep(0.5)
            refused = []
            for s in socks:
                s.settimeout(0.2)
                try:
                    refused.append(s.recv(65536))
                except (TimeoutError, socket.timeout):
                    refused.append(None)
            assert sum(1 for r in refused if r and r.startswith(b"HTTP/1.1 503")) >= 10, refused
            assert all(r is None for r in refused[:15]), "the first connections stay open"
        finally:
            for s in socks:
                s.close()
        time.sleep(0.5)
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        log = server.log(None)
        assert len(re.findall("refusing connections", log)) == 1  # one line, however many were refused


def test_running_out_of_file_descriptors_logs_a_line_not_a_flood():
    with ServerProcess("--timeout-header", "30", fake=True, max_open_files=64) as server:
        socks = [connect(server, b"GET /health HTTP/1.1\r\n") for _ in range(100)]
        try:
            time.sleep(5)  # asyncio retries accept() every second while the descriptors are gone
            log = server.log(None)
        finally:
            for s in socks:
                s.close()
        assert "Traceback" not in log
        assert 1 <= log.count("cannot accept connections") <= 2, log
        assert len(log.splitlines()) < 10
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the descriptors come back as the server sees the closes
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
