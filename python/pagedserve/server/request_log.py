"""The server's log lines about its work, as vLLM writes them: one info line per
finished request and, while the engine is busy, a throughput line every
`interval_s` seconds.

    cmpl-3f2a: finished (length) in 2.41 s: 9 prompt tokens (0 cached), 64 output tokens, TTFT 0.31 s, 30.5 tok/s
    engine: prompt 41.2 tok/s, generation 96.4 tok/s, 3 running, 1 waiting, KV cache 12.5% used

A StepObserver: every hook runs on the engine loop thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

logger = logging.getLogger("pagedserve.server")

# A pause between steps longer than this starts a new throughput window.
IDLE_GAP_S = 1.0


@dataclass
class _Tally:
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    reasons: set = field(default_factory=set)

    @property
    def reason(self) -> str:
        return next(iter(self.reasons)) if len(self.reasons) == 1 else "mixed" if self.reasons else "stop"


class RequestLog:
    def __init__(self, log_requests: bool = True, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, log: logging.Logger = logger):
        self.log_requests = log_requests
        self.interval_s = interval_s
        self._clock = clock
        self._log = log
        self._requests: dict[str, _Tally] = {}
        self._window_start: Optional[float] = None
        self._last_step_end: Optional[float] = None
        self._prompt_tokens = 0  # prefilled in this window
        self._generated_tokens = 0
        self._step_generated = 0  # since the last on_step

    # ------------------------------------------------------------------ StepObserver
    def on_request_added(self, request_id: str, num_prompt_tokens: int) -> None:
        if self.log_requests:
            self._requests[request_id] = _Tally(num_prompt_tokens)

    def on_outputs(self, outputs: list) -> None:
        for out in outputs:
            new = sum(len(c.token_ids) for c in out.outputs)
            self._step_generated += new
            tally = self._requests.get(out.request_id)
            if tally is None:
                continue
            tally.output_tokens += new
            tally.cached_tokens = max(tally.cached_tokens, getattr(out, "num_cached_tokens", 0) or 0)
            tally.reasons.update(c.finish_reason for c in out.outputs if c.finish_reason)
            if out.finished:
                self._finished(out, self._requests.pop(out.request_id))

    def on_step(self, step_seconds: float, stats: dict) -> None:
        if self.interval_s <= 0:
            return
        now = self._clock()
        started = now - step_seconds
        if self._last_step_end is None or started - self._last_step_end > IDLE_GAP_S:
            self._window_start = started  # idle time is not throughput: a new window
            self._prompt_tokens = self._generated_tokens = 0
        self._last_step_end = now
        self._prompt_tokens += int(stats.get("step_prefill_tokens", 0))
        self._generated_tokens += self._step_generated
        self._step_generated = 0
        elapsed = now - self._window_start
        if elapsed >= self.interval_s:
            self._log.info("engine: prompt %.1f tok/s, generation %.1f tok/s, %d running, %d waiting, "
                           "KV cache %.1f%% used", self._prompt_tokens / elapsed, self._generated_tokens / elapsed,
                           stats.get("num_running", 0), stats.get("num_waiting", 0),
                           100.0 * stats.get("pool_utilization", 0.0))
            self._window_start = now
            self._prompt_tokens = self._generated_tokens = 0

    def on_requests_dropped(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self._requests.pop(rid, None) is not None:
                self._log.info("%s: failed with the engine step", rid)

    # ------------------------------------------------------------------ lines
    def _finished(self, out, tally: _Tally) -> None:
        m = out.metrics
        end = m.finished_time if m.finished_time is not None else m.last_token_time
        total = f" in {end - m.arrival_time:.2f} s" if end is not None else ""
        ttft = m.time_to_first_token
        ttft_text = f"{ttft:.2f} s" if ttft is not None else "-"
        decode = None
        if tally.output_tokens > 1 and m.first_token_time is not None and m.last_token_time is not None:
            seconds = m.last_token_time - m.first_token_time
            decode = (tally.output_tokens - 1) / seconds if seconds > 0 else None
        rate = f"{decode:.1f} tok/s" if decode is not None else "- tok/s"
        self._log.info("%s: finished (%s)%s: %d prompt tokens (%d cached), %d output tokens, TTFT %s, %s",
                       out.request_id, tally.reason, total, tally.prompt_tokens, tally.cached_tokens,
                       tally.output_tokens, ttft_text, rate)
