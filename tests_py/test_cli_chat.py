"""`pagedserve chat`: exit words, /reset, Ctrl-C during a reply (the request aborted, the conversation kept,
back at the prompt), first over a scripted engine in-process, then the real command with a real SIGINT."""

from __future__ import annotations

import argparse
import io
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from pagedserve.cli_chat import run_chat
from pagedserve.cli_run import Output
from pagedserve.outputs import CompletionOutput

WORD = " word"


class ChatTokenizer:
    """Renders a chat as 'role: content' lines; ids are bytes."""

    chat_template = "role: content"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant:" if add_generation_prompt
                                                                               else "")

    def encode(self, text, add_special_tokens=True):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode()


class ScriptedEngine:
    """Replies WORD per step, `reply_tokens` steps; `interrupt_at` sends this process SIGINT at that step
    of the first request (as a terminal's Ctrl-C would)."""

    def __init__(self, reply_tokens: int = 3, interrupt_at: int | None = None):
        self.tokenizer = ChatTokenizer()
        self.reply_tokens, self.interrupt_at = reply_tokens, interrupt_at
        self.prompts: dict[str, str] = {}
        self.aborted: list[str] = []
        self.params = []
        self._running: dict[str, int] = {}
        self._steps = 0

    def info(self):
        return SimpleNamespace(model_name="scripted", tokenizer=self.tokenizer, device="cpu",
                               default_sampling={"temperature": 0.5, "top_p": 0.8, "repetition_penalty": 1.2})

    def add_request(self, request_id, prompt, params):
        self.prompts[request_id] = self.tokenizer.decode(prompt["prompt_token_ids"])
        self.params.append(params)
        self._running[request_id] = 0

    def has_unfinished_requests(self):
        return bool(self._running)

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        self._running.pop(request_id, None)
        return []

    def step(self):
        self._steps += 1
        if self.interrupt_at is not None and self._steps == self.interrupt_at and len(self.prompts) == 1:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
        outs = []
        for rid in list(self._running):
            self._running[rid] += 1
            done = self._running[rid] >= self.reply_tokens
            finish = "length" if done else None
            outs.append(SimpleNamespace(request_id=rid, finished=done,
                                        outputs=[CompletionOutput(0, WORD, [1], finish_reason=finish)]))
            if done:
                del self._running[rid]
        return outs


def chat(engine, script: str, monkeypatch, capsys, system=None, overrides=None):
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    rc = run_chat(engine, argparse.Namespace(system=system), overrides or {"max_tokens": 50, "seed": 0},
                  out=Output(sys.stdout))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize("word", ["exit", "quit", "/exit", "/quit", "EXIT", "  quit  "])
def test_exit_words_leave(word, monkeypatch, capsys):
    engine = ScriptedEngine()
    rc, out, err = chat(engine, f"{word}\nHello\n", monkeypatch, capsys)
    assert rc == 0 and not engine.prompts  # "Hello" was never sent


def test_end_of_input_leaves(monkeypatch, capsys):
    rc, _, err = chat(ScriptedEngine(), "Hello\n", monkeypatch, capsys)
    assert rc == 0 and "exit" in err  # the banner says how to leave


def test_conversation_carries_over_and_reset_says_so(monkeypatch, capsys):
    engine = ScriptedEngine()
    rc, out, err = chat(engine, "Hi\nAgain\n/reset\nFresh\nexit\n", monkeypatch, capsys)
    assert rc == 0
    first, second, third = (engine.prompts[f"chat-{i}"] for i in range(3))
    assert second.startswith(first) and f"assistant: {WORD * 3}\n" in second and "user: Again" in second
    assert third == "user: Fresh\nassistant:"
    assert "conversation reset" in err
    assert out.count(WORD * 3) == 3


def test_unset_flags_take_the_engine_defaults(monkeypatch, capsys):
    engine = ScriptedEngine()
    chat(engine, "Hi\n", monkeypatch, capsys, overrides={"max_tokens": 50, "seed": 0, "top_p": 0.5})
    params = engine.params[0]
    assert (params.temperature, params.top_p, params.repetition_penalty) == (0.5, 0.5, 1.2)


def test_ctrl_c_stops_the_reply_and_keeps_the_conversation(monkeypatch, capsys):
    engine = ScriptedEngine(reply_tokens=100, interrupt_at=3)
    rc, out, err = chat(engine, "Tell me a story\nAnd then?\nexit\n", monkeypatch, capsys)
    assert rc == 0
    assert engine.aborted == ["chat-0"]
    assert "(stopped)" in err
    second = engine.prompts["chat-1"]
    assert "user: Tell me a story" in second and "user: And then?" in second
    partial = second.split("assistant:")[1].split("\n")[0]
    assert 0 < partial.count(WORD) < 100  # the reply so far, kept in the conversation
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored after the reply


def test_ctrl_c_at_the_prompt_does_not_leave(monkeypatch, capsys):
    class Stdin(io.StringIO):
        interrupted = False

        def readline(self, *args):
            if not self.interrupted:
                self.interrupted = True
                raise KeyboardInterrupt
            return super().readline(*args)

    monkeypatch.setattr(sys, "stdin", Stdin("Hi\nexit\n"))
    engine = ScriptedEngine()
    assert run_chat(engine, argparse.Namespace(system=None), {"max_tokens": 5, "seed": 0}) == 0
    assert "chat-0" in engine.prompts and "Ctrl-D" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the real command
def start(*argv: str) -> tuple[subprocess.Popen, list[bytes]]:
    """The command with pipes; a thread collects stdout as it comes."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    chunks: list[bytes] = []

    def read() -> None:
        while chunk := os.read(proc.stdout.fileno(), 4096):
            chunks.append(chunk)

    threading.Thread(target=read, daemon=True).start()
    return proc, chunks


def wait_for(chunks: list[bytes], predicate, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate(b"".join(chunks)):
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {proc.stderr.read().decode()}")
        assert time.monotonic() < deadline, b"".join(chunks)
        time.sleep(0.05)


def test_real_chat_ctrl_c_returns_to_the_prompt(default_model_path):
    proc, chunks = start("chat", "--device", "cpu", "--model", str(default_model_path), "--max-tokens", "1000",
                         "--ignore-eos")
    proc.stdin.write(b"Tell me a long story.\n")
    proc.stdin.flush()
    wait_for(chunks, lambda out: len(out) > len(b"> ") + 20, proc)  # the reply is streaming
    os.kill(proc.pid, signal.SIGINT)
    wait_for(chunks, lambda out: out.rstrip().endswith(b">"), proc, timeout=60)  # back at the prompt
    proc.stdin.write(b"/reset\nexit\n")
    proc.stdin.close()
    assert proc.wait(timeout=120) == 0
    err = proc.stderr.read().decode()
    assert "(stopped)" in err and "conversation reset" in err and "Traceback" not in err
