"""`pagedserve serve` as a user starts it: the port is held before it is
announced, a port in use is one line and exit status 1, bad server flags are
refused before anything loads, and the log has a line per finished request
and a periodic throughput line (over the fake engine: no model to load)."""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

from server_process import REPO_ROOT, ServerProcess, subprocess_env
from pagedserve.engine_config import add_engine_args
from pagedserve.server.args import add_server_args, server_defaults


def occupied_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


@pytest.mark.parametrize("fake", [False, True])
def test_a_port_in_use_is_one_clear_line_and_status_1(fake):
    with occupied_port() as sock:
        port = sock.getsockname()[1]
        server = ServerProcess(fake=fake)
        server.port = port
        cmd = server.command()
        started = time.monotonic()
        result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                                env=subprocess_env())
    assert result.returncode == 1, result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert lines == [f"pagedserve: error: port {port} on 127.0.0.1 is in use (is another server running?); "
                     f"stop it or pick another port with --port"], lines
    assert time.monotonic() - started < 60  # refused before the model loads


def test_the_port_is_held_when_listening_is_announced():
    server = ServerProcess("--fake-load-seconds", "3", fake=True).start(wait=False)
    try:
        deadline = time.monotonic() + 60
        while "listening on" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert f"pagedserve: listening on http://127.0.0.1:{server.port}" in server.log()
        assert httpx.get(server.url + "/health", timeout=5).json() == {"status": "loading"}
        server.wait_healthy()
    finally:
        server.stop()


def test_bad_server_flags_are_refused_before_loading():
    result = subprocess.run([sys.executable, "tests_py/fake_engine.py", "--max-connections", "0"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60,
                            env=subprocess_env())
    assert result.returncode != 0 and "--max-connections must be positive" in result.stderr


def test_server_args_show_their_defaults_and_combine_with_the_engines():
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_server_args(parser)
    add_engine_args(parser)
    text = parser.format_help()
    for flag in ("--host", "--port", "--api-key", "--allowed-hosts", "--served-model-name", "--max-num-waiting",
                 "--max-request-bytes", "--max-connections", "--timeout-header", "--timeout-body",
                 "--log-stats-interval"):
        assert flag in text
    assert "(default: 8000)" in text and "(default: 4096)" in text
    assert text.count("(default:") >= text.count("\n  --") - 2  # every flag shows its default, once
    assert "(default: None) (default" not in text
    defaults = server_defaults()
    assert defaults["port"] == 8000 and defaults["max_num_waiting"] == 4096


def test_the_log_has_a_line_per_request_and_a_throughput_line():
    with ServerProcess("--fake-step-seconds", "0.02", "--log-stats-interval", "0.5", fake=True) as server:
        out = httpx.post(server.url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 60},
                         timeout=60).json()
        chat = httpx.post(server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2}, timeout=60).json()
        time.sleep(0.2)
        log = server.log(None)
    line = re.search(rf"{out['id']}: finished \(length\) in [\d.]+ s: 11 prompt tokens \(0 cached\), 60 output "
                     rf"tokens, TTFT [\d.]+ s, [\d.]+ tok/s", log)
    assert line, log
    assert re.search(rf"{chat['id']}: finished \(length\) .* 6 output tokens", log), log
    throughput = re.findall(r"engine: prompt [\d.]+ tok/s, generation ([\d.]+) tok/s, \d+ running, \d+ waiting, "
                            r"KV cache [\d.]+% used", log)
    assert 1 <= len(throughput) <= 4 and float(throughput[0]) > 10, log
    assert "Traceback" not in log
