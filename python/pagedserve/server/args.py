"""The flags of `pagedserve serve` that belong to the HTTP server (the engine's
come from pagedserve.engine_config.add_engine_args).

    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_server_args(parser)
    add_engine_args(parser)
    serve(parser.parse_args())

Each flag's default lives here and only here: server_defaults() reads them
back, so serve() also works on a namespace built without these flags.
"""

from __future__ import annotations

import argparse
from typing import Optional

from pagedserve.cli_args import add_chat_template_arg
from pagedserve.server.reasoning import REASONING_PARSERS
from pagedserve.server.tools.parsers import PARSERS

DEFAULT_PORT = 8000


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", metavar="ADDR",
                   help="address to bind (0.0.0.0 or :: for every interface) (default: %(default)s)")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, metavar="N", help="TCP port (default: %(default)s)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on the API, /docs and /openapi.json "
                        "(default: %(default)s; without a key only local Host headers are answered, "
                        "see --allowed-hosts)")
    g.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="comma-separated Host header names answered when no --api-key is set, besides "
                        "localhost, IP addresses and --host; '*' answers any (guards the page against DNS "
                        "rebinding) (default: %(default)s)")
    g.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                   help="model name(s) in the API: the first is the one responses name, any is accepted as "
                        "'model' and /v1/models lists them all (default: %(default)s, the model "
                        "directory's name)")
    g.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="comma-separated origins allowed by CORS ('*' for any); without it no CORS "
                        "headers are sent (default: %(default)s)")
    add_chat_template_arg(g)
    g.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS), metavar="NAME",
                   help=f"how the model writes tool calls ({', '.join(sorted(PARSERS))}) (default: the shipped "
                        "tools template's, hermes, when the model's template has no tools; else the model "
                        "family's)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted as vLLM spells it: tool_choice \"auto\" is always on (default: %(default)s)")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS), metavar="NAME",
                   help=f"split the model's <think> reasoning into reasoning_content "
                        f"({', '.join(sorted(REASONING_PARSERS))}) (default: %(default)s, all text is content)")
    g.add_argument("--max-num-waiting", type=int, default=4096, metavar="N",
                   help="sequences (prompts x n) that may wait for the engine; a call beyond gets 503, one "
                        "that could never fit gets 400 (default: %(default)s)")
    g.add_argument("--max-request-bytes", type=int, default=1 << 20, metavar="N",
                   help="largest request body accepted, in bytes (default: %(default)s)")
    g.add_argument("--max-connections", type=int, default=1000, metavar="N",
                   help="open connections at most; requests beyond get 503 (default: %(default)s)")
    g.add_argument("--timeout-header", type=float, default=10.0, metavar="SECONDS",
                   help="seconds a client has to send a request's headers (default: %(default)s)")
    g.add_argument("--timeout-body", type=float, default=30.0, metavar="SECONDS",
                   help="seconds a client has to send a request's body (default: %(default)s)")
    g.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="SECONDS",
                   help="seconds an idle keep-alive connection stays open (default: %(default)s)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="do not log a line per finished request (default: %(default)s)")
    g.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between throughput log lines while the engine is busy; 0 turns them off "
                        "(default: %(default)s)")


def server_defaults() -> dict:
    """Every server flag's default, by attribute name."""
    parser = argparse.ArgumentParser(add_help=False)
    add_server_args(parser)
    return vars(parser.parse_args([]))


def with_server_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the server flags it lacks set to their defaults (a parser that added only some)."""
    merged = {**server_defaults(), **vars(args)}
    return argparse.Namespace(**merged)


def check_server_args(args: argparse.Namespace) -> None:
    """Raises ValueError naming the first flag out of range (before the model loads)."""
    positive = {"max_num_waiting": "--max-num-waiting", "max_request_bytes": "--max-request-bytes",
                "max_connections": "--max-connections", "timeout_header": "--timeout-header",
                "timeout_body": "--timeout-body", "timeout_keep_alive": "--timeout-keep-alive"}
    for name, flag in positive.items():
        if getattr(args, name) <= 0:
            raise ValueError(f"{flag} must be positive, got {getattr(args, name)}")
    if args.log_stats_interval < 0:
        raise ValueError(f"--log-stats-interval must be 0 (off) or positive, got {args.log_stats_interval}")
    names = args.served_model_name
    if names is not None and (not names or any(not isinstance(n, str) or not n.strip() for n in
                                                ([names] if isinstance(names, str) else names))):
        raise ValueError(f"--served-model-name needs non-empty names, got {names!r}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")


def served_model_names(value) -> list[str]:
    """--served-model-name as a list ([] when not given; a plain string from code is one name)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def parse_allowed_origins(value: Optional[str]) -> Optional[list[str]]:
    """--allowed-origins as a list, None when CORS is off."""
    if value is None:
        return None
    origins = [o.strip() for o in value.split(",") if o.strip()]
    return origins or None
