"""ServerContext: what every route needs, gathered in one object that the app
holds (no module-level state): the async engine, what the engine told about
itself (EngineInfo: name, tokenizer, limits, sampling defaults), metrics and
the server's own settings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedserve.engine.info import EngineInfo
from pagedserve.engine.validation import EngineLimits
from pagedserve.errors import RequestError
from pagedserve.server.async_engine import AsyncEngine, EngineOverloaded, EngineUnavailable, OutputStream
from pagedserve.server.errors import from_request_error, model_not_found, service_unavailable
from pagedserve.server.metrics import ServerMetrics


@dataclass
class ServerContext:
    async_engine: AsyncEngine
    api_key: Optional[str] = None
    max_request_bytes: int = 1 << 20
    body_timeout_s: float = 30.0
    allowed_hosts: Optional[set[str]] = None  # None: any Host header (or an API key guards the server)
    served_model_name: Optional[str] = None  # None: the model directory's name, once loaded
    model_aliases: list[str] = field(default_factory=list)  # further names accepted as "model"
    allowed_origins: Optional[list[str]] = None  # CORS origins; None: no CORS
    chat_template: Optional[str] = None  # --chat-template's text; None: the model's own
    tool_call_parser: Optional[str] = None  # --tool-call-parser; None: by the template and model family
    reasoning_parser: Optional[str] = None  # --reasoning-parser; None: no reasoning_content
    started_at: float = field(default_factory=time.time)
    # Set once the model has loaded:
    info: Optional[EngineInfo] = None
    metrics: Optional[ServerMetrics] = None
    load_error: Optional[str] = None

    @property
    def tokenizer(self) -> Any:
        return self.info.tokenizer if self.info is not None else None

    @property
    def limits(self) -> Optional[EngineLimits]:
        return self.info.limits if self.info is not None else None

    @property
    def architecture(self) -> str:
        return self.info.architecture if self.info is not None else ""

    @property
    def device(self) -> Optional[str]:
        return self.info.device if self.info is not None else None

    @property
    def default_sampling(self) -> dict:
        return dict(self.info.default_sampling) if self.info is not None else {}

    def require_ready(self) -> None:
        if self.load_error is not None:
            raise service_unavailable(f"the model failed to load: {self.load_error}", "model_load_failed")
        if self.async_engine.dead_error is not None:
            raise service_unavailable(f"engine failed: {self.async_engine.dead_error}", "engine_dead")
        if self.async_engine.stopping:
            raise service_unavailable("the server is shutting down", "shutting_down")
        if self.async_engine.failed:
            raise service_unavailable("the engine loop stopped; see the server log", "engine_failed")
        if not self.async_engine.ready or self.info is None:
            raise service_unavailable("the model is still loading", "model_loading")

    @property
    def served_model_names(self) -> list[str]:
        """Every name the model answers to, the one responses carry first."""
        return [self.served_model_name] + [a for a in self.model_aliases if a != self.served_model_name]

    def check_model(self, name: Optional[str]) -> None:
        """None means the served model, as with a single-model vLLM server; any alias is accepted."""
        if name is not None and name not in self.served_model_names:
            raise model_not_found(name)

    async def generate(self, prompts: list[dict], params, request_id: str, arrival_time: float,
                       prompt_param: Optional[str] = None) -> OutputStream:
        """Submits to the engine, turning its refusals into API errors (`prompt_param` names
        the body field that held the prompt, when it is not "prompt")."""
        try:
            return await self.async_engine.generate(prompts, params, request_id, arrival_time)
        except EngineOverloaded as err:
            self._rejected("overloaded")
            raise service_unavailable(str(err), "overloaded") from err
        except EngineUnavailable as err:
            self._rejected("unavailable")
            raise service_unavailable(str(err), "unavailable") from err
        except RequestError as err:
            self._rejected("invalid")
            raise from_request_error(err, prompt_param if err.field == "prompt" else None) from err

    def _rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.on_rejected(reason)
