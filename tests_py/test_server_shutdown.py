"""Starting and stopping the real server: /health is 503 while the model
loads; SIGTERM aborts the requests in flight (streams end with
finish_reason "abort", waiting callers get a 503) and the process exits 0;
SIGINT on an idle server exits 0 too."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from server_process import ServerProcess

PROMPT = "The capital of France is"
LONG = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}


def stream_until_end(server: ServerProcess, out: dict, started: threading.Event) -> None:
    """Reads one streaming completion to its end, recording what it saw."""
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    started.set()
    out["events"] = events


def test_sigterm_aborts_requests_in_flight_and_exits_zero():
    server = ServerProcess()
    server.start()
    try:
        assert 503 in server.health_codes_seen, "health should answer 503 while the model loads"
        results = [{}, {}]
        started = [threading.Event(), threading.Event()]
        threads = [threading.Thread(target=stream_until_end, args=(server, results[i], started[i]))
                   for i in range(2)]
        plain: dict = {}
        threads.append(threading.Thread(target=lambda: plain.update(
            response=httpx.post(server.url + "/v1/completions", json=LONG, timeout=120))))
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started)
        server.send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        assert server.wait(timeout=30) == 0, server.log()
        assert time.monotonic() - stopped_at < 20
        for t in threads:
            t.join(10)
            assert not t.is_alive()
    finally:
        server.stop(signal.SIGKILL)
    for result in results:
        events = result["events"]
        assert events[-1] == "[DONE]"
        finishes = [c["finish_reason"] for c in map(json.loads, events[:-1]) for c in c["choices"]
                    if c["finish_reason"]]
        assert finishes == ["abort"]
    assert plain["response"].status_code == 503
    assert plain["response"].json()["error"]["type"] == "service_unavailable_error"
    assert "Traceback" not in server.log()


def test_sigint_on_an_idle_server_exits_zero():
    with ServerProcess() as server:
        assert httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                          timeout=120).status_code == 200
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 0, server.log()
        assert "Traceback" not in server.log()
