"""An engine that fails for good (EngineDeadError, as when a rank's process dies) stops the real server
cleanly: the requests in flight end with the reason (a stream's error event, a 500 naming it), /health
answers 503 with it within 5 s, and the process exits with status 1, its log naming the process at fault.
The fake engine raises the error from a step that holds DEAD_TEXT (tests_py/fake_engine.py); the data-
parallel tests kill a real replica process (test_server_data_parallel.py)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from server_process import ServerProcess

DEAD_TEXT = "<die>"
REASON = "engine failed: rank 1 failed: injected: the process died (signal SIGKILL)"


def read_stream(server: ServerProcess, out: dict, started: threading.Event) -> None:
    body = {"prompt": "a long story", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.setdefault("events", []).append(line[6:])
                started.set()


def wait_for_health_503(server: ServerProcess, timeout: float) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = httpx.get(server.url + "/health", timeout=2)
        if response.status_code == 503:
            return response
        time.sleep(0.05)
    raise AssertionError(f"/health did not turn 503 within {timeout} s")


def test_engine_death_fails_requests_turns_health_503_and_exits_1():
    server = ServerProcess("--fake-step-seconds", "0.02", "--fake-dead-prompt", DEAD_TEXT, fake=True)
    server.start()
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        stream_out: dict = {}
        started = threading.Event()
        reader = threading.Thread(target=read_stream, args=(server, stream_out, started))
        reader.start()
        assert started.wait(30)
        plain: dict = {}

        def collect() -> None:
            try:
                client.completions.create(model="fake-model", prompt="another story", max_tokens=200)
            except openai.APIStatusError as err:
                plain["error"] = err
        collector = threading.Thread(target=collect)
        collector.start()
        time.sleep(0.2)  # both are generating
        with pytest.raises(openai.APIStatusError):
            client.completions.create(model="fake-model", prompt=f"please {DEAD_TEXT}", max_tokens=4)
        died_at = time.monotonic()
        health = wait_for_health_503(server, 5)
        assert time.monotonic() - died_at < 5
        assert health.json() == {"status": "failed", "error": REASON}
        assert server.wait(timeout=5) == 1, server.log()
        assert time.monotonic() - died_at < 5.5
        reader.join(10)
        collector.join(10)
    finally:
        server.stop()
    log = server.log()
    assert f"pagedserve: error: {REASON}" in log, log
    events = stream_out["events"]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["message"] == REASON and error["code"] == "engine_dead"
    assert plain["error"].status_code == 500
    assert REASON in str(plain["error"])
