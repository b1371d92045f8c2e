"""AsyncEngine: the engine as the asyncio side of the server sees it.

    stream = await async_engine.generate([prompt], params, "cmpl-1")
    async for prompt_index, delta in stream:   # RequestOutput deltas
        ...
    stream.close()                              # aborts what is unfinished

Submission and abort are thread-safe commands to the EngineLoop thread;
outputs come back on the event loop, where each engine request's outputs
are routed to the queue of the API call that made it. One API call may
hold several engine requests (a completions call with a list of prompts).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional, Sequence

from pagedserve.errors import RequestError
from pagedserve.server.engine_commands import (AbortCommand, AddCommand, EngineDead, EngineStepError,
                                               EngineUnavailable, SnapshotCommand, StepObserver, StopCommand,
                                               WaitingCount)
from pagedserve.server.engine_loop import EngineLoop

__all__ = ["AsyncEngine", "OutputStream", "EngineOverloaded", "EngineUnavailable", "EngineStepError", "EngineDead"]


class EngineOverloaded(Exception):
    """The waiting sequences leave no room for a call now: the client should retry later."""


class OutputStream:
    """The outputs of one API call's engine requests, as (prompt index, RequestOutput delta).

    Iteration ends once every request finished; an engine failure raises
    EngineStepError. close() aborts whatever has not finished, so a caller
    that leaves early (a client disconnect cancels it) frees its KV blocks.
    """

    def __init__(self, engine: "AsyncEngine", request_ids: list[str], outputs: asyncio.Queue):
        self.request_ids = request_ids
        self._engine = engine
        self._outputs = outputs
        self._unfinished = set(request_ids)

    def __aiter__(self) -> "OutputStream":
        return self

    async def __anext__(self) -> tuple[int, Any]:
        if not self._unfinished:
            raise StopAsyncIteration
        index, item = await self._outputs.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return index, item

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def close(self) -> None:
        if self._unfinished:
            self._engine.abort(sorted(self._unfinished))
            self._unfinished.clear()


class AsyncEngine:
    def __init__(self, max_num_waiting: int):
        if max_num_waiting < 1:
            raise ValueError(f"max_num_waiting must be at least 1, got {max_num_waiting}")
        self.max_num_waiting = max_num_waiting
        self._loop_thread: Optional[EngineLoop] = None
        self._event_loop: Optional[asyncio.AbstractEventLoop] = None
        self._waiting = WaitingCount()
        self._routes: dict[str, tuple[asyncio.Queue, int]] = {}  # engine request id -> (queue, prompt index)
        self._stopping = False
        self._dead: Optional[BaseException] = None  # the EngineDeadError that ended the loop
        self._on_dead: Optional[Callable[[BaseException], None]] = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, engine, event_loop: asyncio.AbstractEventLoop, observer: Optional[StepObserver] = None,
              on_dead: Optional[Callable[[BaseException], None]] = None) -> None:
        """Starts the loop thread over a loaded engine; outputs are delivered on `event_loop`.
        `on_dead(error)` runs there once if the engine fails for good (EngineDeadError)."""
        if self._loop_thread is not None:
            raise RuntimeError("the engine loop is already running")
        self._event_loop = event_loop
        self._on_dead = on_dead
        self._loop_thread = EngineLoop(engine, event_loop, self, self._waiting, observer)
        self._loop_thread.start()

    @property
    def ready(self) -> bool:
        return (self._loop_thread is not None and self._loop_thread.is_alive() and not self._stopping
                and self._dead is None)

    @property
    def failed(self) -> bool:
        """The loop thread died (a bug, not a failed step) or the engine failed for good: nothing will be
        served."""
        if self._dead is not None:
            return True
        return self._loop_thread is not None and not self._loop_thread.is_alive() and not self._stopping

    @property
    def dead_error(self) -> Optional[BaseException]:
        """The EngineDeadError that ended the engine (None while it serves)."""
        return self._dead

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def loop_state(self):
        return self._loop_thread.state if self._loop_thread is not None else None

    @property
    def num_waiting(self) -> int:
        return self._waiting.total

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort those in flight (their streams end with finish_reason
        "abort"). Safe to call from a signal handler and from any thread; idempotent."""
        if self._stopping:
            return
        self._stopping = True
        if self._loop_thread is not None:
            self._loop_thread.submit(StopCommand())

    def join(self, timeout: Optional[float] = None) -> bool:
        """Waits for the loop thread to exit; True when it has (or never started)."""
        self.begin_shutdown()
        if self._loop_thread is None:
            return True
        self._loop_thread.join(timeout)
        return not self._loop_thread.is_alive()

    # ------------------------------------------------------------------ requests
    async def generate(self, prompts: Sequence[dict], params, request_id: str,
                       arrival_time: Optional[float] = None) -> OutputStream:
        """Submits one engine request per prompt ({"prompt": text | None, "prompt_token_ids": [...]})
        and waits until the engine accepted them all.

        Raises EngineUnavailable while loading or stopping, RequestError for a call that could
        never fit the waiting bound or that the engine refuses, and EngineOverloaded when the
        waiting sequences leave no room for this call's (prompts x n) now.
        """
        self._check_serving()
        num_seqs = len(prompts) * params.n
        if num_seqs > self.max_num_waiting:
            raise RequestError(f"this call asks for {num_seqs} sequences ({len(prompts)} prompt(s) x n={params.n}), "
                               f"more than the server queues at once (--max-num-waiting {self.max_num_waiting}); "
                               f"split it into smaller calls", "n" if params.n > self.max_num_waiting else "prompt",
                               "too_many_sequences")
        if self.num_waiting + num_seqs > self.max_num_waiting:
            raise EngineOverloaded(f"the server has {self.num_waiting} sequences waiting "
                                   f"(--max-num-waiting {self.max_num_waiting}); retry later")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        outputs: asyncio.Queue = asyncio.Queue()
        ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        accepted = []
        self._waiting.add_submitted(num_seqs)
        for index, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
            self._routes[rid] = (outputs, index)
            future = self._event_loop.create_future()
            accepted.append(future)
            self._loop_thread.submit(AddCommand(rid, prompt, params, arrival, future))
        stream = OutputStream(self, ids, outputs)
        try:
            await asyncio.gather(*accepted)
        except BaseException:  # refused, or the caller was cancelled (client gone)
            for future in accepted:
                future.cancel()
            stream.close()
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Aborts engine requests (event loop thread); their blocks return at the next step boundary."""
        for rid in request_ids:
            self._routes.pop(rid, None)
        if self._loop_thread is not None and self._loop_thread.is_alive():
            self._loop_thread.submit(AbortCommand(list(request_ids)))

    async def read(self, reader: Callable[[Any, EngineLoop], Any]) -> Any:
        """Runs `reader(engine, loop)` on the loop thread between steps and returns its value
        (the engine is an EngineClient; the reader may call its methods, the loop thread's own)."""
        self._check_serving()
        done = self._event_loop.create_future()
        self._loop_thread.submit(SnapshotCommand(reader, done))
        return await done

    def _check_serving(self) -> None:
        if self._dead is not None:
            raise EngineUnavailable(f"engine failed: {self._dead}")
        if self._stopping:
            raise EngineUnavailable("the server is shutting down")
        if self._loop_thread is None:
            raise EngineUnavailable("the model is still loading")
        if not self._loop_thread.is_alive():
            raise EngineUnavailable("the engine loop has stopped")

    # ------------------------------------------------------------------ OutputRouter (event loop thread)
    def deliver(self, outputs: list) -> None:
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue  # aborted by its caller
            queue, index = route
            queue.put_nowait((index, out))
            if out.finished:
                del self._routes[out.request_id]

    def fail(self, request_ids: list[str], error: BaseException) -> None:
        for rid in request_ids:
            route = self._routes.pop(rid, None)
            if route is not None:
                queue, index = route
                queue.put_nowait((index, error))

    def engine_dead(self, error: BaseException) -> None:
        if self._dead is not None:
            return
        self._dead = error
        if self._on_dead is not None:
            self._on_dead(error)
