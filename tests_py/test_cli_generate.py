"""`pagedserve generate` on the default model: progress on stderr only, errors on their own line,
Ctrl-C exits quietly with 130."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

from test_cli_chat import start, wait_for

PROMPT = "The capital of France is"


def generate(default_model_path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve.cli", "generate", *argv, "--device", "cpu",
                           "--model", str(default_model_path)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_progress_goes_to_stderr_and_the_text_to_stdout(default_model_path):
    result = generate(default_model_path, PROMPT, "--max-tokens", "4", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(PROMPT) and "loading" not in result.stdout
    assert re.search(rf"^loading {default_model_path.name} \.\.\. \d+\.\d s \(on cpu\)$", result.stderr, re.M), \
        result.stderr


def test_an_error_after_loading_is_on_its_own_line(default_model_path):
    result = generate(default_model_path, "Hi", "--max-model-len", "32", "--max-tokens", "64")
    assert result.returncode == 2
    assert result.stdout == ""  # the prompt is echoed only once generation starts
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("pagedserve: error: ") and "max_model_len (32)" in last, result.stderr


def test_ctrl_c_exits_quietly_with_130(default_model_path):
    proc, chunks = start("generate", PROMPT, "--device", "cpu", "--model", str(default_model_path),
                         "--max-tokens", "1000", "--ignore-eos")
    proc.stdin.close()
    wait_for(chunks, lambda out: len(out) > len(PROMPT) + 10, proc)
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    err = proc.stderr.read().decode()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert b"".join(chunks).decode().endswith("\n")  # the partial line is ended


def test_ctrl_c_while_loading_exits_quietly_with_130(default_model_path):
    proc, _ = start("generate", PROMPT, "--device", "cpu", "--model", str(default_model_path))
    proc.stdin.close()
    seen = b""
    while b"loading" not in seen and (chunk := os.read(proc.stderr.fileno(), 256)):
        seen += chunk
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    err = (seen + proc.stderr.read()).decode()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
