"""EngineClient: everything the server may ask of an engine, declared.

LLMEngine implements it, and so does the tests' fake; nothing under server/
reaches past it (no worker, scheduler or request records). The engine loop
thread is the only caller, so implementations need no locks. Any method may
raise pagedserve.errors.EngineDeadError: the engine cannot go on, and the
server stops (see engine_loop.py).
"""

from __future__ import annotations

from typing import Optional, Protocol

from pagedserve.engine.info import EngineInfo
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams


class EngineClient(Protocol):
    def info(self) -> EngineInfo:
        """The model's name, device, tokenizer, limits and sampling defaults."""

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams,
                    arrival_time: Optional[float] = None) -> None:
        """Queues a request ({"prompt": text | None, "prompt_token_ids": [...]}); its outputs come back
        as deltas from step(). Raises RequestError (a ValueError) for a request it refuses."""

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        """Drops requests (their KV blocks return at once); returns the final outputs
        (finish_reason "abort") of those that were still running."""

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the deltas it produced."""

    def stats(self) -> dict:
        """Scheduler and token counters (cheap: read after every step for /metrics)."""

    def snapshot(self) -> dict:
        """The engine page's view: stats, block map, running and waiting requests."""

    def check_health(self) -> None:
        """Raises EngineDeadError when a process the engine depends on (a tensor-parallel rank, a
        data-parallel replica) died or hung. Cheap: called about once a second while the engine is idle
        (step() and the commands raise it themselves while it works)."""

    def shutdown(self) -> None:
        """Stops the engine for good (its processes joined, its memory freed): called once, by the loop
        thread, when the loop ends."""
