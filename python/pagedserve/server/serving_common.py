"""Pieces both completion APIs share: usage counting, finish fields, and the
responses for a client that left or an engine that failed."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi.responses import JSONResponse, Response

from pagedserve.server.context import ServerContext
from pagedserve.server.errors import (ErrorResponse, error_body, internal_error_body, internal_error_response,
                                     new_error_id)
from pagedserve.server.async_engine import EngineDead, EngineStepError, OutputStream
from pagedserve.server.streaming import CLIENT_CLOSED_REQUEST, DONE, sse

logger = logging.getLogger("pagedserve.server")


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    # Prompt tokens the prefix cache held, per prompt of the call (RequestOutput.num_cached_tokens).
    cached_by_prompt: dict[int, int] = field(default_factory=dict)

    def add(self, prompt_index: int, out) -> None:
        """Counts one RequestOutput delta of the call's prompt `prompt_index`."""
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        cached = getattr(out, "num_cached_tokens", 0) or 0
        if cached > self.cached_by_prompt.get(prompt_index, 0):
            self.cached_by_prompt[prompt_index] = cached

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_by_prompt.values())}}


def finish_fields(c) -> dict:
    """finish_reason plus vLLM's stop_reason (the stop string or token id that ended the choice)."""
    return {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def aborted_by_shutdown(ctx: ServerContext, finals: list[dict]) -> bool:
    return ctx.async_engine.stopping and any(f.get("finish_reason") == "abort" for f in finals)


def client_gone() -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


def _log_failure(call_id: str, err: Exception) -> str:
    error_id = new_error_id()
    # The engine loop logged the traceback when the step failed; this ties the call to it.
    logger.error("%s failed (error id %s): %s", call_id, error_id, err)
    return error_id


def engine_failure_response(call_id: str, err: Exception) -> JSONResponse:
    if isinstance(err, EngineDead):
        return ErrorResponse(_engine_dead_body(call_id, err), status_code=500)
    return internal_error_response(_log_failure(call_id, err))


def engine_failure_event(call_id: str, err: Exception) -> dict:
    """The error event a stream ends with when the engine failed under it."""
    if isinstance(err, EngineDead):
        return _engine_dead_body(call_id, err)
    return internal_error_body(_log_failure(call_id, err))


def _engine_dead_body(call_id: str, err: EngineDead) -> dict:
    """A dead engine's reason names a process and a cause, never request data: the client may read it."""
    logger.info("%s ended: %s", call_id, err)
    return error_body(500, str(err), code="engine_dead")


async def sse_events(call_id: str, stream: OutputStream, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """A streamed call's server-sent events: its chunks, an error event if the engine failed under it,
    then [DONE]. The call's engine requests are closed (aborted if unfinished) however it ends."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except EngineStepError as err:
        yield sse(engine_failure_event(call_id, err))
    finally:
        stream.close()
    yield DONE
