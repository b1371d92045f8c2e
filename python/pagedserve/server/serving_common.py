"""Pieces both completion APIs share: usage counting, finish fields, and the
responses for a client that left or an engine that failed."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response

from pagedserve.server.context import ServerContext
from pagedserve.server.errors import error_body
from pagedserve.server.streaming import CLIENT_CLOSED_REQUEST


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def finish_fields(c) -> dict:
    """finish_reason plus vLLM's stop_reason (the stop string or token id that ended the choice)."""
    return {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def aborted_by_shutdown(ctx: ServerContext, finals: list[dict]) -> bool:
    return ctx.async_engine.stopping and any(f.get("finish_reason") == "abort" for f in finals)


def client_gone() -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


def engine_failure_response(err: Exception) -> JSONResponse:
    return JSONResponse(error_body(500, str(err)), status_code=500)
