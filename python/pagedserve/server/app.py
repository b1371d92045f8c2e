"""The OpenAI-compatible server: `pagedserve serve`.

    pagedserve serve --port 8000 [--model DIR] [--api-key KEY] [engine options]

serve() binds the port first (a port in use is one line and exit status 1),
then announces it; the HTTP server comes up at once and answers /health with
503 while the model loads on a thread of its own; then one engine loop
thread serves every connection (see async_engine.py). SIGINT / SIGTERM stop
accepting, abort the requests in flight (streams end with finish_reason
"abort"), join the loop thread and exit 0.

An engine that fails for good (EngineDeadError: a rank or replica process died
or hung) fails the requests in flight with its reason, turns /health to 503
with it, and the server exits with status 1 within seconds (FATAL_EXIT_SECONDS
at the latest), its last line "pagedserve: error: engine failed: <who> failed:
<why>".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Callable, Optional

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from pagedserve.cli_args import read_chat_template
from pagedserve.server.args import (check_server_args, parse_allowed_origins, served_model_names,
                                    with_server_defaults)
from pagedserve.server.async_engine import AsyncEngine
from pagedserve.server.connections import (BindError, GuardedH11Protocol, RateLimitedLog, RateLimitFilter,
                                           bind_socket, loop_exception_handler, raise_open_file_limit, socket_url)
from pagedserve.server.context import ServerContext
from pagedserve.server.engine_client import EngineClient
from pagedserve.server.engine_commands import Observers
from pagedserve.server.errors import InternalErrorMiddleware, install_error_handlers
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.middleware import (APIKeyMiddleware, BodyLimitMiddleware, HostCheckMiddleware,
                                          parse_allowed_hosts)
from pagedserve.server.request_log import RequestLog
from pagedserve.server.routes import add_routes

logger = logging.getLogger("pagedserve.server")

# Seconds uvicorn waits for connections to finish after a signal; aborted streams end within a step.
SHUTDOWN_GRACE_SECONDS = 10
LOOP_JOIN_SECONDS = 30
# After the engine died: /health answers 503 this long before the server stops (a probe sees why), and
# the process is gone after FATAL_EXIT_SECONDS whatever still runs (the issue allows 5 s in all).
FATAL_LINGER_SECONDS = 0.5
FATAL_EXIT_SECONDS = 4.0


def build_app(ctx: ServerContext, on_startup: Optional[Callable[[asyncio.AbstractEventLoop], None]] = None) -> FastAPI:
    """The ASGI app. `on_startup(loop)` runs when the server starts (it begins loading the model)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if on_startup is not None:
            on_startup(asyncio.get_running_loop())
        yield
        ctx.async_engine.begin_shutdown()
        joined = await asyncio.to_thread(ctx.async_engine.join, LOOP_JOIN_SECONDS)
        if not joined:
            logger.error("the engine loop did not stop within %d s", LOOP_JOIN_SECONDS)

    app = FastAPI(title="pagedserve", summary="OpenAI-compatible LLM server", lifespan=lifespan,
                  docs_url="/docs", redoc_url=None)
    install_error_handlers(app)
    add_routes(app, ctx)
    # Added last = runs first: the Host and the key are checked before the body is read.
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=ctx.max_request_bytes, timeout_s=ctx.body_timeout_s)
    if ctx.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=ctx.api_key)
    elif ctx.allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed=ctx.allowed_hosts)
    if ctx.allowed_origins:  # outermost: preflight OPTIONS is answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=ctx.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in ctx.allowed_origins)
    return app


def attach_engine(ctx: ServerContext, engine: EngineClient, loop: asyncio.AbstractEventLoop,
                  request_log: Optional[RequestLog] = None,
                  on_dead: Optional[Callable[[BaseException], None]] = None) -> None:
    """Fills the context from a loaded engine's info() and starts the engine loop (event loop thread);
    `on_dead(error)` runs on the event loop if the engine fails for good."""
    if ctx.async_engine.stopping:
        return  # a signal came while loading
    info = engine.info()
    ctx.served_model_name = ctx.served_model_name or info.model_name
    ctx.info = info
    async_engine = ctx.async_engine
    ctx.metrics = ServerMetrics(ctx.served_model_name,
                                lambda: async_engine.loop_state.stats if async_engine.loop_state else None)
    async_engine.start(engine, loop, Observers([ctx.metrics, request_log]), on_dead=on_dead)


def start_loading(ctx: ServerContext, build_engine: Callable[[], EngineClient], loop: asyncio.AbstractEventLoop,
                  on_ready: Callable[[], None], on_failure: Callable[[], None],
                  request_log: Optional[RequestLog] = None,
                  on_dead: Optional[Callable[[BaseException], None]] = None) -> threading.Thread:
    """Builds the engine on a daemon thread, then attaches it on the event loop."""

    def load() -> None:
        try:
            engine = build_engine()
        except BaseException as err:  # report it on /health and exit, rather than hang
            if isinstance(err, ValueError):  # a bad option or path: the message says it all
                print(f"pagedserve: error: the model failed to load: {err}", file=sys.stderr, flush=True)
            else:
                logger.exception("the model failed to load")
            ctx.load_error = f"{type(err).__name__}: {err}"
            _call_in_loop(loop, on_failure)
            return

        def attach() -> None:
            attach_engine(ctx, engine, loop, request_log, on_dead)
            on_ready()
        _call_in_loop(loop, attach)

    thread = threading.Thread(target=load, name="pagedserve-model-loader", daemon=True)
    thread.start()
    return thread


def _call_in_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:  # the server stopped while the model loaded: nothing is waiting for it
        pass


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that aborts in-flight requests on SIGINT / SIGTERM and exits 0.

    uvicorn on its own waits for streams to finish (minutes of generation) and
    re-raises the signal once it has shut down, so the process would die by it.
    """

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for connections
        self.should_exit = True
        self._on_exit()


def _default_engine(args: argparse.Namespace) -> Callable[[], EngineClient]:
    from pagedserve.engine_config import engine_config_from_args

    config = engine_config_from_args(args)  # a bad option fails here, before the port is taken

    def build():
        from pagedserve.engine.data_parallel import build_engine
        return build_engine(config)  # LLMEngine, or replicas behind one client with --data-parallel-size
    return build


def _configure_logging(verbose: bool) -> None:
    """Info lines of the server (per request, throughput) show without -v; -v adds uvicorn's access log."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedserve.server").setLevel(logging.INFO)


def serve(args: argparse.Namespace, build_engine: Optional[Callable[[], EngineClient]] = None) -> int:
    """Runs the server until a signal: 0 on a clean stop, 1 when the port cannot be bound or the
    model failed to load. `build_engine` replaces LLMEngine(config from args) (tests)."""
    args = with_server_defaults(args)
    check_server_args(args)
    chat_template = read_chat_template(args.chat_template)  # a missing file fails before the port is taken
    build_engine = build_engine or _default_engine(args)
    verbose = getattr(args, "verbose", False)
    _configure_logging(verbose)
    raise_open_file_limit()
    try:
        sock = bind_socket(args.host, args.port)
    except BindError as err:
        print(f"pagedserve: error: {err}", file=sys.stderr, flush=True)
        return 1
    url = socket_url(sock)
    ctx = ServerContext(AsyncEngine(args.max_num_waiting), api_key=args.api_key,
                        max_request_bytes=args.max_request_bytes, body_timeout_s=args.timeout_body,
                        allowed_hosts=parse_allowed_hosts(args.allowed_hosts, args.host),
                        served_model_name=(served_model_names(args.served_model_name) or [None])[0],
                        model_aliases=served_model_names(args.served_model_name)[1:],
                        allowed_origins=parse_allowed_origins(args.allowed_origins), chat_template=chat_template,
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    request_log = RequestLog(log_requests=not args.disable_log_requests, interval_s=args.log_stats_interval)
    flood = RateLimitedLog()
    server: Optional[GracefulServer] = None

    def on_startup(loop: asyncio.AbstractEventLoop) -> None:
        loop.set_exception_handler(loop_exception_handler(flood))
        start_loading(ctx, build_engine, loop, on_ready, on_failure, request_log, on_dead)

    def on_ready() -> None:
        print(f"pagedserve: serving {ctx.served_model_name} on {ctx.device} at {url} "
              f"(max_model_len {ctx.limits.max_model_len})", file=sys.stderr, flush=True)

    def on_failure() -> None:
        server.should_exit = True

    def on_dead(error: BaseException) -> None:
        print(f"pagedserve: error: engine failed: {error}; exiting", file=sys.stderr, flush=True)
        _exit_after(FATAL_EXIT_SECONDS)
        asyncio.get_running_loop().call_later(FATAL_LINGER_SECONDS, on_failure)

    app = build_app(ctx, on_startup)
    protocol = GuardedH11Protocol.configure(args.timeout_header, args.max_connections, flood)
    config = uvicorn.Config(app, http=protocol, access_log=verbose, log_level="info" if verbose else "warning",
                            timeout_keep_alive=args.timeout_keep_alive, limit_concurrency=args.max_connections,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS)
    logging.getLogger("uvicorn.error").addFilter(RateLimitFilter())
    server = GracefulServer(config, on_exit=ctx.async_engine.begin_shutdown)
    print(f"pagedserve: listening on {url}, loading the model", file=sys.stderr, flush=True)
    with sock:
        server.run(sockets=[sock])
    return 1 if ctx.load_error is not None or ctx.async_engine.dead_error is not None else 0


def _exit_after(seconds: float) -> None:
    """Ends the process with status 1 after `seconds` if the orderly stop has not ended it by then
    (a connection or an engine shutdown that hangs must not keep a dead server up)."""

    def watchdog() -> None:
        time.sleep(seconds)
        print(f"pagedserve: error: the server did not stop within {seconds:g} s of the engine failure; "
              f"exiting", file=sys.stderr, flush=True)
        os._exit(1)
    threading.Thread(target=watchdog, name="pagedserve-exit-watchdog", daemon=True).start()
