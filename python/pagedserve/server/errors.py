"""OpenAI-style errors: every failure the API reports has one body shape,

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

so clients (the official `openai` package included) surface a readable
message instead of a bare status code. Handlers route APIError, the engine's
RequestError, FastAPI's validation errors and Starlette's HTTP errors here;
InternalErrorMiddleware turns anything unexpected into a 500 that names an
error id and nothing else (the log has the traceback under that id).
"""

from __future__ import annotations

import json
import logging
import uuid
from http import HTTPStatus
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.errors import RequestError

logger = logging.getLogger("pagedserve.server")

# OpenAI's `type` for each status we answer with.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}

# Seconds a client should wait before retrying an overloaded or loading server.
RETRY_AFTER_SECONDS = 1


class ErrorResponse(JSONResponse):
    """A JSON body in plain ASCII: an error message may quote what the client sent, and text
    that is not valid Unicode (a lone surrogate) must not break the response that rejects it."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class APIError(Exception):
    """An error the API reports to the client as an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return ErrorResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, *, param: Optional[str] = None,
               code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_request_error(err: RequestError, param: Optional[str] = None) -> APIError:
    """The 400 for a request the engine's checks refused; `param` renames the field
    (e.g. the chat API's prompt is its "messages")."""
    return bad_request(err.message, param or err.field, err.code)


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def service_unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def new_error_id() -> str:
    return f"err-{uuid.uuid4().hex[:16]}"


def internal_error_body(error_id: str) -> dict[str, Any]:
    """What a 500 tells the client: that it happened and the id the log files it under."""
    return error_body(500, f"internal server error (error id {error_id}; the server log has the details)",
                      code="internal_error")


def internal_error_response(error_id: str) -> JSONResponse:
    return ErrorResponse(internal_error_body(error_id), status_code=500)


def _validation_message(err: RequestValidationError) -> tuple[str, Optional[str]]:
    """The first validation problem as (message, param), phrased for people."""
    problems = err.errors()
    if not problems:
        return "invalid request", None
    first = problems[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        return f"the request body is not valid JSON: {detail}", None
    if first.get("type") == "missing" and not loc:
        return "the request body is missing (send a JSON object)", None
    param = ".".join(loc) if loc else None
    if first.get("type") == "missing":
        return f"'{param}' is required", param
    if first.get("type") == "extra_forbidden":
        return (f"'{param}' is not supported by this server (see the README's table of OpenAI and vLLM "
                f"request fields)", param)
    got = first.get("input")
    shown = json.dumps(got)[:80] if _jsonable(got) else repr(got)[:80]
    where = f"'{param}'" if param else "the request body"
    more = f" ({len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    return f"{where}: {first.get('msg', 'invalid value')}, got {shown}{more}", param


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, err: RequestError) -> JSONResponse:
        return from_request_error(err).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(err)
        return ErrorResponse(error_body(400, message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, err: StarletteHTTPException) -> JSONResponse:
        message = err.detail if isinstance(err.detail, str) else HTTPStatus(err.status_code).phrase
        return ErrorResponse(error_body(err.status_code, message), status_code=err.status_code,
                             headers=getattr(err, "headers", None))


class InternalErrorMiddleware:
    """Innermost ASGI middleware: an exception no handler took becomes a logged 500 naming an error
    id. Starlette's own handler would re-raise it after answering, so uvicorn would log it twice and
    drop the keep-alive connection. Once a response has started (a stream), only closing the
    connection can signal the failure: returning with the response unfinished makes uvicorn do that."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as err:
            error_id = new_error_id()
            logger.error("internal error %s while serving %s %s", error_id, scope.get("method"), scope.get("path"),
                         exc_info=err)
            if not started:
                await internal_error_response(error_id)(scope, receive, send)
