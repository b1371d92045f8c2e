"""What crosses between the event loop and the engine loop thread: the
commands the server submits, the hooks the loop calls back, and the count of
waiting sequences both sides keep."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence


class EngineUnavailable(Exception):
    """The engine is not serving (still loading, or shutting down)."""


class EngineStepError(RuntimeError):
    """engine.step() raised: the requests in flight were aborted."""


class EngineDead(EngineStepError):
    """The engine failed for good (EngineDeadError): the requests in flight end with this, whose
    message ("engine failed: replica 1 failed: ...") is for the client too; the server exits."""


@dataclass
class AddCommand:
    request_id: str
    prompt: dict
    params: Any  # SamplingParams
    arrival_time: float
    accepted: asyncio.Future  # resolves to None, or fails with the engine's RequestError

    @property
    def num_seqs(self) -> int:
        return self.params.n


@dataclass
class AbortCommand:
    request_ids: list[str]


@dataclass
class SnapshotCommand:
    read: Callable[[Any, Any], Any]  # (engine, EngineLoop) -> value, run on the loop thread
    done: asyncio.Future


class StopCommand:
    pass


class StepObserver(Protocol):
    """Metrics and logging hooks, called on the loop thread."""

    def on_request_added(self, request_id: str, num_prompt_tokens: int) -> None: ...

    def on_outputs(self, outputs: list) -> None: ...  # deltas of a step, or the finals of aborts

    def on_step(self, step_seconds: float, stats: dict) -> None: ...  # stats: engine.stats() after the step

    def on_requests_dropped(self, request_ids: list[str]) -> None: ...  # failed without a final output


class Observers:
    """Several StepObservers as one."""

    def __init__(self, observers: Sequence[Optional[StepObserver]]):
        self._observers = [o for o in observers if o is not None]

    def on_request_added(self, request_id: str, num_prompt_tokens: int) -> None:
        for o in self._observers:
            o.on_request_added(request_id, num_prompt_tokens)

    def on_outputs(self, outputs: list) -> None:
        for o in self._observers:
            o.on_outputs(outputs)

    def on_step(self, step_seconds: float, stats: dict) -> None:
        for o in self._observers:
            o.on_step(step_seconds, stats)

    def on_requests_dropped(self, request_ids: list[str]) -> None:
        for o in self._observers:
            o.on_requests_dropped(request_ids)


class OutputRouter(Protocol):
    """Where outputs go, called on the event loop thread."""

    def deliver(self, outputs: list) -> None: ...

    def fail(self, request_ids: list[str], error: BaseException) -> None: ...

    def engine_dead(self, error: BaseException) -> None: ...  # the engine raised EngineDeadError


class WaitingCount:
    """Sequences (prompts x n) not yet generating: submitted but not yet applied by
    the loop, plus those waiting in the engine. Both change under one lock so the
    sum never counts a sequence twice or misses one in between."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._submitted = 0
        self._engine_waiting = 0

    def add_submitted(self, n: int) -> None:
        with self._lock:
            self._submitted += n

    def publish(self, applied: int, engine_waiting: int) -> None:
        with self._lock:
            self._submitted -= applied
            self._engine_waiting = engine_waiting

    @property
    def total(self) -> int:
        with self._lock:
            return self._submitted + self._engine_waiting
