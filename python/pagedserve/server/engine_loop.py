"""EngineLoop: the one thread that owns the engine (an EngineClient).

It loops: apply the commands that arrived (add, abort, snapshot, stop), run
one engine.step() while anything is unfinished, and hand the step's outputs
to the event loop in a single call_soon_threadsafe. When nothing is
unfinished it sleeps on the command queue (waking each second to ask the
engine's check_health()). No other thread touches the engine, so the engine
needs no locks, and a request that arrives mid-step joins the running batch at
the next step boundary.

An engine that raises EngineDeadError (a rank or replica process died or hung)
ends the loop: every request in flight fails with EngineDead (its message
names the process and why), later commands are refused, the router's
engine_dead() tells the server (which answers /health 503 and exits), and the
engine is shut down. Any other step exception fails the requests in flight
with EngineStepError and the loop serves on.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pagedserve.errors import EngineDeadError, RequestError
from pagedserve.server.engine_client import EngineClient
from pagedserve.server.engine_commands import (AbortCommand, AddCommand, EngineDead, EngineStepError,
                                               EngineUnavailable, OutputRouter, SnapshotCommand, StepObserver,
                                               StopCommand, WaitingCount)

logger = logging.getLogger("pagedserve.server")

# Steps remembered for the engine view's batch-composition chart.
STEP_HISTORY_LENGTH = 240
# Seconds between the idle loop's engine.check_health() calls: a replica that dies while nothing runs is
# reported within this (plus the server's exit), well inside the 5 s the issue allows.
IDLE_HEALTH_CHECK_SECONDS = 1.0


@dataclass
class StepRecord:
    time: float
    prefill_tokens: int
    decode_tokens: int
    num_seqs: int


@dataclass
class LoopState:
    """What the loop publishes after each iteration, read by other threads."""

    stats: dict = field(default_factory=dict)
    steps: collections.deque = field(default_factory=lambda: collections.deque(maxlen=STEP_HISTORY_LENGTH))
    num_steps: int = 0
    num_step_failures: int = 0
    dead: Optional[EngineDeadError] = None  # set once, when the engine failed for good


class EngineLoop(threading.Thread):
    def __init__(self, engine: EngineClient, event_loop: asyncio.AbstractEventLoop, router: OutputRouter,
                 waiting: WaitingCount, observer: Optional[StepObserver] = None):
        super().__init__(name="pagedserve-engine-loop", daemon=True)
        self.engine = engine
        self.state = LoopState(stats=engine.stats())
        self._event_loop = event_loop
        self._router = router
        self._waiting = waiting
        self._observer = observer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._applied_seqs = 0
        # The requests this loop added that have not finished: request id -> samples not yet forked. The
        # engine counts a request's n samples as one waiting sequence until its prompt is in (they fork
        # with the first token), so the loop adds the other n - 1 to the waiting count until then.
        self._live: dict[str, int] = {}
        self._unforked = 0

    def submit(self, command) -> None:
        """Thread-safe and reentrant (SimpleQueue.put), so a signal handler may call it."""
        self._commands.put(command)

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        refusal = EngineUnavailable("the server is shutting down")
        try:
            while self._serve_once():
                pass
        except EngineDeadError as err:
            self._die(err)
            refusal = EngineUnavailable(f"engine failed: {err}")
        except Exception:  # a bug in the loop itself: fail everything rather than hang clients
            logger.exception("the engine loop died")
            self._fail_everything(EngineStepError("the engine loop died"))
        finally:
            self._refuse_remaining_commands(refusal)
            self._shutdown_engine()

    def _serve_once(self) -> bool:
        idle = not self.engine.has_unfinished_requests()
        commands = self._take_commands(block=idle)
        if idle and not commands:
            self.engine.check_health()
            self._publish(stepped=False)  # an engine of other processes may have news (blocks freed by aborts)
            return True
        for i, command in enumerate(commands):
            if isinstance(command, StopCommand):
                self._abort(list(self._live))
                self._refuse(commands[i + 1:])
                self._publish()
                return False
            self._apply(command)
        step_seconds = self._step() if self.engine.has_unfinished_requests() else None
        stats = self._publish(stepped=step_seconds is not None)
        if step_seconds is not None and self._observer is not None:
            self._observer.on_step(step_seconds, stats)
        return True

    def _take_commands(self, block: bool) -> list:
        commands = []
        if block:
            try:
                commands.append(self._commands.get(timeout=IDLE_HEALTH_CHECK_SECONDS))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command) -> None:
        try:
            self._apply_one(command)
        except EngineDeadError:
            raise
        except Exception as err:  # an engine bug on one command must not stop the loop for everyone
            logger.exception("engine command %s failed", type(command).__name__)
            future = getattr(command, "accepted", None) or getattr(command, "done", None)
            if future is not None:
                self._resolve(future, EngineStepError(f"the engine failed: {type(err).__name__}: {err}"))

    def _apply_one(self, command) -> None:
        if isinstance(command, AddCommand):
            self._add(command)
        elif isinstance(command, AbortCommand):
            self._abort(command.request_ids)
        elif isinstance(command, SnapshotCommand):
            self._snapshot(command)
        else:
            raise TypeError(f"unknown engine command {command!r}")

    def _add(self, command: AddCommand) -> None:
        self._applied_seqs += command.num_seqs
        if command.accepted.cancelled():  # the client left before its request got here
            return
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params,
                                    arrival_time=command.arrival_time)
        except RequestError as err:
            self._resolve(command.accepted, err)
            return
        self._live[command.request_id] = command.num_seqs - 1
        self._unforked += command.num_seqs - 1
        if self._observer is not None:
            self._observer.on_request_added(command.request_id, len(command.prompt["prompt_token_ids"]))
        self._resolve(command.accepted, None)

    def _abort(self, request_ids: list[str]) -> None:
        ids = [rid for rid in request_ids if rid in self._live]  # others finished or were never added
        if not ids:
            return
        for rid in ids:
            self._forget(rid)
        finals = self.engine.abort_request(ids)  # the samples' "abort" finishes
        if finals:
            self._to_event_loop(self._router.deliver, finals)
            if self._observer is not None:
                self._observer.on_outputs(finals)

    def _forget(self, request_id: str) -> None:
        self._unforked -= self._live.pop(request_id, 0)

    def _track(self, outputs: list) -> None:
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)
            elif self._live.get(out.request_id):
                self._unforked -= self._live[out.request_id]
                self._live[out.request_id] = 0

    def _snapshot(self, command: SnapshotCommand) -> None:
        try:
            value = command.read(self.engine, self)
        except EngineDeadError:
            raise
        except Exception as err:  # a bad reader must not take the loop down
            self._resolve(command.done, err)
            return
        self._resolve(command.done, None, value)

    def _step(self) -> Optional[float]:
        """Runs one step; its duration, or None when it failed."""
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except EngineDeadError:
            raise
        except Exception as err:
            logger.exception("engine.step() failed; aborting the requests in flight")
            self.state.num_step_failures += 1
            self._fail_everything(EngineStepError(f"the engine failed: {type(err).__name__}: {err}"))
            return None
        seconds = time.perf_counter() - start
        self.state.num_steps += 1
        self._track(outputs)
        if outputs:
            self._to_event_loop(self._router.deliver, outputs)
        if self._observer is not None:
            self._observer.on_outputs(outputs)
        return seconds

    def _publish(self, stepped: bool = True) -> dict:
        stats = self.engine.stats()
        if stepped and stats.get("step_num_seqs"):
            self.state.steps.append(StepRecord(time.time(), int(stats["step_prefill_tokens"]),
                                               int(stats["step_decode_tokens"]), int(stats["step_num_seqs"])))
        self.state.stats = stats
        self._waiting.publish(self._applied_seqs, int(stats.get("num_waiting", 0)) + self._unforked)
        self._applied_seqs = 0
        return stats

    # ------------------------------------------------------------------ failure and shutdown
    def _die(self, error: EngineDeadError) -> None:
        """The engine cannot go on: tell the server first (its /health turns 503 at once), then fail
        every request in flight with the reason."""
        logger.error("engine failed: %s", error)
        self.state.dead = error
        self._to_event_loop(self._router.engine_dead, error)
        self._fail_everything(EngineDead(f"engine failed: {error}"))

    def _shutdown_engine(self) -> None:
        try:
            self.engine.shutdown()
        except Exception:  # the process is ending: log it, never hang or mask the first failure
            logger.exception("the engine's shutdown failed")

    def _fail_everything(self, error: BaseException) -> None:
        ids = list(self._live)
        for rid in ids:
            self._forget(rid)
        if not ids:
            return
        try:
            self.engine.abort_request(ids)  # their outputs are dropped: the callers get `error`
        except Exception:
            logger.exception("could not abort %d requests after an engine failure", len(ids))
        self._to_event_loop(self._router.fail, ids, error)
        if self._observer is not None:
            self._observer.on_requests_dropped(ids)

    def _refuse_remaining_commands(self, gone: EngineUnavailable) -> None:
        self._refuse(self._take_commands(block=False), gone)
        self._waiting.publish(self._applied_seqs, 0)
        self._applied_seqs = 0

    def _refuse(self, commands: list, gone: Optional[EngineUnavailable] = None) -> None:
        gone = gone or EngineUnavailable("the server is shutting down")
        for command in commands:
            if isinstance(command, AddCommand):
                self._applied_seqs += command.num_seqs
                self._resolve(command.accepted, gone)
            elif isinstance(command, SnapshotCommand):
                self._resolve(command.done, gone)

    # ------------------------------------------------------------------ crossing to the event loop
    def _resolve(self, future: asyncio.Future, error: Optional[BaseException], value: Any = None) -> None:
        def settle() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)
        self._to_event_loop(settle)

    def _to_event_loop(self, fn: Callable, *args) -> None:
        try:
            self._event_loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop already closed: nobody is left to tell
            pass
