"""SamplingParams: how one request chooses its tokens and when it stops.

The field names, defaults and accepted ranges follow vLLM's ``SamplingParams``
so user code can switch between the two engines unchanged. Validation happens
once, at construction; the sampler and the engine then trust the values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

# Temperatures below this are treated as greedy: dividing logits by a value this
# small overflows float32 for ordinary logit magnitudes, and the result would be
# argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5

# OpenAI's documented range for the additive penalties.
ADDITIVE_PENALTY_RANGE = (-2.0, 2.0)

# top_k values that mean "consider the whole vocabulary" (vLLM accepts both).
TOP_K_DISABLED = 0


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_DISABLED  # 0 or -1: disabled (normalized to 0)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None  # normalized to list[str]
    stop_token_ids: Optional[list[int]] = None  # normalized to list[int]
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16  # None: bounded only by the model's context
    min_tokens: int = 0
    logprobs: Optional[int] = None  # top-N raw logprobs per sampled token; 0: the sampled one only
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self._normalize()
        self._check_counts()
        self._check_distribution_shaping()
        self._check_penalties()
        self._check_stops()
        if self.greedy:
            self._disable_truncation_for_greedy()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    # -- validation -----------------------------------------------------------------

    def _normalize(self) -> None:
        if self.top_k == -1:
            self.top_k = TOP_K_DISABLED
        if self.seed == -1:  # vLLM's OpenAI server treats -1 as "no seed"
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)

    def _check_counts(self) -> None:
        _require_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.max_tokens is not None:
            _require_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _require_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be at least 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}")
        if self.logprobs is not None:
            _require_int("logprobs", self.logprobs)
            if self.logprobs < 0:
                raise ValueError(f"logprobs must be at least 0 (or None), got {self.logprobs}")
        if self.seed is not None:
            _require_int("seed", self.seed)

    def _check_distribution_shaping(self) -> None:
        _require_finite("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        _require_finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _require_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}")
        _require_finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    def _check_penalties(self) -> None:
        low, high = ADDITIVE_PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require_finite(name, value)
            if not low <= value <= high:
                raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value}")
        _require_finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than 0, got {self.repetition_penalty}")

    def _check_stops(self) -> None:
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must hold strings, got {s!r}")
            if not s:
                raise ValueError("stop must not contain an empty string")
        for t in self.stop_token_ids:
            _require_int("stop_token_ids", t)
            if t < 0:
                raise ValueError(f"stop_token_ids must be non-negative, got {t}")

    def _disable_truncation_for_greedy(self) -> None:
        # Truncation cannot change an argmax; resetting keeps the sampler's fast path.
        self.top_p = 1.0
        self.top_k = TOP_K_DISABLED
        self.min_p = 0.0


def _require_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")


def _require_finite(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
