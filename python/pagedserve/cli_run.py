"""What `generate` and `chat` share: checking the arguments before the model loads, loading it with a
progress line, and streaming one request that Ctrl-C stops cleanly.

Order matters for a quick answer: the sampling flags and the prompt text are checked first (no torch
import, a tenth of a second); then, under one progress line on stderr, the model directory is resolved,
the prompt tokenized and checked again as the engine will (limits not known yet), and the engine loads.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

from pagedserve.cli_args import build_sampling_params, sampling_overrides
from pagedserve.errors import RequestError
from pagedserve.sampling_params import SamplingParams


def check_args(args: argparse.Namespace, prompt: Optional[str] = None) -> dict[str, Any]:
    """The sampling fields the command line sets, once they and the prompt text pass the engine's checks.
    Raises RequestError (a ValueError) naming the field."""
    from pagedserve.engine.validation import check_text

    overrides = sampling_overrides(args)
    build_sampling_params(overrides)  # the ranges; the model's own defaults are valid by construction
    if prompt is not None:
        check_text(prompt)
        if not prompt:
            raise RequestError("the prompt is empty", "prompt", "empty_prompt")
    return overrides


@dataclass
class Loaded:
    engine: Any
    prompt_ids: Optional[list[int]] = None  # the prompt's ids (chat: as a user message), when it had one


def load_engine(args: argparse.Namespace, overrides: dict[str, Any], prompt: Optional[str] = None,
                chat: bool = False, err: Optional[TextIO] = None) -> Loaded:
    """Resolves the model, checks the prompt's token ids, loads the engine, under one progress line on
    stderr: "loading NAME ... 2.1 s (on cpu)"."""
    err = err or sys.stderr
    verbose = getattr(args, "verbose", False)
    label = f"loading {Path(args.model).expanduser().name if args.model else 'the default model'}"
    err.write(f"{label} ...\n" if verbose else f"{label} ... ")
    err.flush()
    start = time.perf_counter()
    try:
        loaded = _load(args, overrides, prompt, chat)
    except BaseException:
        if not verbose:
            err.write("\n")  # the error or ^C starts on a line of its own
        raise
    info = loaded.engine.info()
    name = "" if args.model else f"{info.model_name} "
    took = f"{time.perf_counter() - start:.1f} s ({name}on {info.device})"
    err.write(f"{label}: {took}\n" if verbose else f"{took}\n")
    err.flush()
    return loaded


def _load(args: argparse.Namespace, overrides: dict[str, Any], prompt: Optional[str], chat: bool) -> Loaded:
    from pagedserve.engine.fast_tokenizer import load_fast_tokenizer
    from pagedserve.engine.validation import EngineLimits, validate_request
    from pagedserve.engine_config import engine_config_from_args
    from pagedserve.models.default_model import model_path

    model_dir = model_path(args.model)
    tok = load_fast_tokenizer(model_dir)  # the engine's own (shared), when the directory allows it
    ids = None
    if prompt is not None and tok is not None:
        from pagedserve.engine.tokenizer import apply_chat_template, encode_prompt

        ids = apply_chat_template(tok, [{"role": "user", "content": prompt}]) if chat else encode_prompt(tok, prompt)
        ids = validate_request(ids, build_sampling_params(overrides), EngineLimits())
    from pagedserve.engine.engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args).with_updates(model=str(model_dir)))
    return Loaded(engine, ids)


def engine_sampling_params(engine, overrides: dict[str, Any]) -> SamplingParams:
    """The command's SamplingParams over the loaded model's defaults."""
    return build_sampling_params(overrides, engine.info().default_sampling)


class StopOnInterrupt:
    """Ctrl-C while a reply streams sets `hit` instead of raising in the middle of an engine step."""

    def __init__(self) -> None:
        self.hit = False
        self._previous = None

    def __enter__(self) -> "StopOnInterrupt":
        self._previous = signal.signal(signal.SIGINT, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        self.hit = True

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


@dataclass
class Reply:
    texts: list[str]
    tokens: int = 0
    seconds: float = 0.0
    interrupted: bool = False
    started: bool = False  # the first output arrived (so `echo` was written)


@dataclass
class Output:
    """stdout, remembering whether its last line is unfinished (an error then starts on a new line)."""

    stream: TextIO = field(default_factory=lambda: sys.stdout)
    open_line: bool = False

    def write(self, text: str) -> None:
        if text:
            self.stream.write(text)
            self.stream.flush()
            self.open_line = not text.endswith("\n")

    def end_line(self) -> None:
        if self.open_line:
            self.write("\n")


def stream_reply(engine, request_id: str, prompt, params: SamplingParams, out: Output,
                 echo: str = "") -> Reply:
    """Runs one request, streaming its text when n == 1 (after `echo`, written once the first output
    arrives). Ctrl-C aborts the request and returns what came so far (interrupted=True)."""
    reply = Reply([""] * params.n)
    start = time.perf_counter()
    with StopOnInterrupt() as stop:
        engine.add_request(request_id, prompt, params)
        while engine.has_unfinished_requests():
            if stop.hit:
                engine.abort_request(request_id)
                reply.interrupted = True
                break
            for delta in engine.step():
                if not reply.started:
                    reply.started = True
                    out.write(echo)
                for c in delta.outputs:
                    reply.texts[c.index] += c.text
                    reply.tokens += len(c.token_ids)
                    if params.n == 1:
                        out.write(c.text)
    if params.n > 1:
        for i, text in enumerate(reply.texts):
            out.write(f"\n--- completion {i} ---\n{text}")
    out.end_line()
    reply.seconds = time.perf_counter() - start
    return reply


def error_message(err: BaseException) -> str:
    """An error as the command reports it: flags by their spelling on the command line."""
    field_name = getattr(err, "field", None)
    if isinstance(err, RequestError) and field_name and field_name != "prompt":
        return f"argument --{field_name.replace('_', '-')}: {err}"
    return str(err)
