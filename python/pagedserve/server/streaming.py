"""Server-sent events and client disconnects.

A streaming response is an async generator of SSE lines; Starlette cancels
it when the client disconnects (it listens for http.disconnect while
streaming), and the generator's cleanup aborts the engine requests. A
non-streaming request has no such listener, so until_disconnected() races
the work against the client leaving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator, Awaitable, Optional, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

T = TypeVar("T")

DONE = "data: [DONE]\n\n"

# Not a registered status: nginx's "client closed request", logged when the client left first.
CLIENT_CLOSED_REQUEST = 499


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    # X-Accel-Buffering: reverse proxies must pass tokens on as they come.
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def wait_for_disconnect(request: Request) -> None:
    """Returns once the client has disconnected (the request body must already be read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, work: Awaitable[T]) -> Optional[T]:
    """`work`'s result, or None when the client disconnected first; `work` is then
    cancelled, and its own cleanup aborts what it had started."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return None
    return task.result()
