"""Runs the real `pagedserve serve` as a subprocess on 127.0.0.1 for the server tests.

    with ServerProcess("--max-num-seqs", "8") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused")

With fake=True the same server runs over tests_py/fake_engine.py's FakeEngine
(no model: up in a second); its args are server flags and --fake-* options.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
# Loading can include the one-time conversion of the default model (tens of seconds on 2 cores).
STARTUP_TIMEOUT_S = 600
# The CPU engine options every server test shares: a short context keeps error cases small.
CPU_ARGS = ("--device", "cpu", "--max-model-len", "1024")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env() -> dict:
    """The environment for a child process that imports pagedserve: the same pagedserve as the tests
    (the installed one, or the tree's python/ when the tests run from it with a dev build)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    # One torch thread: the server shares 2 cores with the test's clients, and OpenMP's spinning
    # workers slow every step many times over when a core is taken.
    env.setdefault("OMP_NUM_THREADS", "1")
    import pagedserve
    source = str(Path(pagedserve.__file__).resolve().parents[1])
    if source == str(REPO_ROOT / "python") and source not in env.get("PYTHONPATH", "").split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
    return env


class ServerProcess:
    def __init__(self, *args: str, api_key: Optional[str] = None, fake: bool = False,
                 max_open_files: Optional[int] = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self.api_key = api_key
        self.fake = fake
        self.max_open_files = max_open_files  # RLIMIT_NOFILE of the server process (soft and hard)
        self.args = ([] if fake else list(CPU_ARGS)) + list(args) + (["--api-key", api_key] if api_key else [])
        self.health_codes_seen: set[int] = set()
        self._log = tempfile.NamedTemporaryFile("w+", prefix="pagedserve-server-", suffix=".log", delete=False)
        self.process: Optional[subprocess.Popen] = None

    # ------------------------------------------------------------------ lifecycle
    def command(self) -> list[str]:
        entry = [str(Path(__file__).with_name("fake_engine.py"))] if self.fake else ["-m", "pagedserve.cli", "serve"]
        return [sys.executable, *entry, "--host", "127.0.0.1", "--port", str(self.port), *self.args]

    def start(self, wait: bool = True) -> "ServerProcess":
        cmd = self.command()
        env = subprocess_env()
        limit = self.max_open_files

        def limit_open_files() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
        self.process = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, preexec_fn=limit_open_files if limit else None)
        if wait:
            self.wait_healthy()
        return self

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            try:
                code = httpx.get(self.url + "/health", timeout=5).status_code
                self.health_codes_seen.add(code)
                if code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the server was not healthy after {timeout} s:\n{self.log()}")

    def send_signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> Optional[int]:
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise

    def log(self, tail: Optional[int] = 8000) -> str:
        """The server's output so far (its last `tail` characters; None: all of it)."""
        self._log.flush()
        text = Path(self._log.name).read_text(errors="replace")
        return text if tail is None else text[-tail:]

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self._log.close()
        os.unlink(self._log.name)

    # ------------------------------------------------------------------ helpers for tests
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(), timeout=60, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        headers = {**self.headers(), **kw.pop("headers", {})}
        return httpx.post(self.url + path, headers=headers, timeout=kw.pop("timeout", 300), **kw)

    def engine_state(self) -> dict:
        response = self.get("/v1/engine/state")
        response.raise_for_status()
        return response.json()

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: metric name -> value (samples of one name summed)."""
        values: dict[str, float] = {}
        for line in self.get("/metrics").text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_and_labels, value = line.rsplit(" ", 1)
            name = name_and_labels.split("{", 1)[0]
            values[name] = values.get(name, 0.0) + float(value)
        return values

    def wait_idle(self, timeout: float = 60) -> dict:
        """The engine state once nothing runs or waits (aborts land at the next step boundary)."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.engine_state()
            if not state["running"] and not state["waiting"] and state["num_unfinished_requests"] == 0:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine is still busy: {state['running']} {state['waiting']}")
            time.sleep(0.1)
