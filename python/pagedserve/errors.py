"""RequestError: the one error type for a request the engine refuses.

Raised by SamplingParams (at construction) and by the engine's request check
(pagedserve.engine.validation), so the offline API, the CLI and the server see
the same message. It is a ValueError, as vLLM's are; `field` names the request
field at fault (a SamplingParams name, or "prompt") and `code` says why in a
word a program can branch on. The server turns it into an OpenAI 400 body
with `param=field` and `code=code`.
"""

from __future__ import annotations

from typing import Optional


class RequestError(ValueError):
    def __init__(self, message: str, field: Optional[str] = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message = message
        self.field = field
        self.code = code


class EngineDeadError(RuntimeError):
    """The engine cannot run another step: a tensor-parallel rank or a data-parallel replica died or hung.

    ``who`` names the process at fault ("rank 1", "replica 0") and the message says why. Unlike a
    RequestError it is not about one request: the offline API raises it to the caller, and the server
    reports 503 on /health and exits non-zero with the message.
    """

    def __init__(self, who: str, why: str):
        super().__init__(f"{who} failed: {why}")
        self.who = who
        self.why = why
