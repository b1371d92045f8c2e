"""ServerContext: what every route needs, gathered in one object that the app
holds (no module-level state): the async engine, the model's name and
tokenizer, the configured limits, metrics and the API key."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from pagedserve.server.async_engine import AsyncEngine, EngineOverloaded, EngineUnavailable, OutputStream
from pagedserve.server.engine_inputs import EngineLimits
from pagedserve.server.errors import bad_request, model_not_found, service_unavailable
from pagedserve.server.metrics import ServerMetrics


@dataclass
class ServerContext:
    async_engine: AsyncEngine
    api_key: Optional[str] = None
    max_request_bytes: int = 1 << 20
    served_model_name: Optional[str] = None  # None: the model directory's name, once loaded
    started_at: float = field(default_factory=time.time)
    # Set once the model has loaded:
    tokenizer: object = None
    limits: Optional[EngineLimits] = None
    metrics: Optional[ServerMetrics] = None
    model_dir: Optional[str] = None
    device: Optional[str] = None
    load_error: Optional[str] = None

    def require_ready(self) -> None:
        if self.load_error is not None:
            raise service_unavailable(f"the model failed to load: {self.load_error}", "model_load_failed")
        if self.async_engine.stopping:
            raise service_unavailable("the server is shutting down", "shutting_down")
        if self.async_engine.failed:
            raise service_unavailable("the engine loop stopped; see the server log", "engine_failed")
        if not self.async_engine.ready or self.limits is None:
            raise service_unavailable("the model is still loading", "model_loading")

    def check_model(self, name: Optional[str]) -> None:
        """None means the served model, as with a single-model vLLM server."""
        if name is not None and name != self.served_model_name:
            raise model_not_found(name)

    async def generate(self, prompts: list[dict], params, request_id: str, arrival_time: float) -> OutputStream:
        """Submits to the engine, turning its refusals into API errors."""
        try:
            return await self.async_engine.generate(prompts, params, request_id, arrival_time)
        except EngineOverloaded as err:
            self._rejected("overloaded")
            raise service_unavailable(str(err), "overloaded") from err
        except EngineUnavailable as err:
            self._rejected("unavailable")
            raise service_unavailable(str(err), "unavailable") from err
        except (ValueError, TypeError) as err:
            self._rejected("invalid")
            raise bad_request(str(err)) from err

    def _rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.on_rejected(reason)
