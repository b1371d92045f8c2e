"""SamplingParams: how one request chooses its tokens and when it stops.

The field names, defaults and accepted ranges follow vLLM's ``SamplingParams``
so user code can switch between the two engines unchanged. Validation happens
once, at construction; the sampler and the engine then trust the values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from pagedserve.errors import RequestError

# Temperatures below this are treated as greedy: dividing logits by a value this
# small overflows float32 for ordinary logit magnitudes, and the result would be
# argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5

# OpenAI's documented range for the additive penalties.
ADDITIVE_PENALTY_RANGE = (-2.0, 2.0)

# The sampling defaults of every front end (CLI, chat, page, API, LLM.generate without params) where the
# model's generation_config.json sets none: mild randomness, and a repetition penalty that keeps small models
# (the default SmolLM2-135M) from looping. The SamplingParams class keeps vLLM's own defaults.
DEFAULT_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}

# OpenAI's range for a logit_bias value.
LOGIT_BIAS_RANGE = (-100.0, 100.0)

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
    prompt_logprobs: Optional[int] = None  # top-N raw logprobs per prompt position; 0: the prompt token only
    skip_special_tokens: bool = True
    # Logits processors, applied before every other sampling parameter (vLLM's names):
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: Optional[list[int]] = None  # only these may be sampled
    bad_words: Optional[list[str]] = None  # never completed (token sequences, with and without a leading space)
    structured_outputs: Optional["StructuredOutputsParams"] = None  # grammar-constrained output

    def __post_init__(self) -> None:
        self._normalize()
        self._check_structured_outputs()
        self._check_counts()
        self._check_distribution_shaping()
        self._check_penalties()
        self._check_stops()
        self._check_logits_processors()
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
    def has_logits_processors(self) -> bool:
        """True when logit_bias, allowed_token_ids or bad_words change the logits."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words)

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
            raise RequestError(f"n must be at least 1, got {self.n}", "n")
        if self.max_tokens is not None:
            _require_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        _require_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise RequestError(f"min_tokens must be at least 0, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens must be at most max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}", "min_tokens")
        if self.logprobs is not None:
            _require_int("logprobs", self.logprobs)
            if self.logprobs < 0:
                raise RequestError(f"logprobs must be at least 0 (or None), got {self.logprobs}", "logprobs")
        if self.prompt_logprobs is not None:
            _require_int("prompt_logprobs", self.prompt_logprobs)
            if self.prompt_logprobs < 0:
                raise RequestError(f"prompt_logprobs must be at least 0 (or None), got {self.prompt_logprobs}",
                                   "prompt_logprobs")
        if self.seed is not None:
            _require_int("seed", self.seed)

    def _check_distribution_shaping(self) -> None:
        _require_finite("temperature", self.temperature)
        if self.temperature < 0.0:
            raise RequestError(f"temperature must be non-negative, got {self.temperature}", "temperature")
        _require_finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _require_int("top_k", self.top_k)
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}", "top_k")
        _require_finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")

    def _check_penalties(self) -> None:
        low, high = ADDITIVE_PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require_finite(name, value)
            if not low <= value <= high:
                raise RequestError(f"{name} must be in [{low:g}, {high:g}], got {value}", name)
        _require_finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise RequestError(f"repetition_penalty must be greater than 0, got {self.repetition_penalty}",
                               "repetition_penalty")

    def _check_stops(self) -> None:
        for s in self.stop:
            if not isinstance(s, str):
                raise RequestError(f"stop must hold strings, got {s!r}", "stop")
            if not s:
                raise RequestError("stop must not contain an empty string", "stop")
        for t in self.stop_token_ids:
            _require_int("stop_token_ids", t)
            if t < 0:
                raise RequestError(f"stop_token_ids must be non-negative, got {t}", "stop_token_ids")

    def _check_structured_outputs(self) -> None:
        so = self.structured_outputs
        if so is None:
            return
        if isinstance(so, dict):
            try:
                so = self.structured_outputs = StructuredOutputsParams(**so)
            except TypeError as err:
                raise RequestError(f"structured_outputs: {err}", "structured_outputs") from None
        if not isinstance(so, StructuredOutputsParams):
            raise RequestError(f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}",
                               "structured_outputs")

    def _check_logits_processors(self) -> None:
        # bad_words as token id sequences: set by the engine from its tokenizer (engine/tokenizer.py).
        self.bad_words_token_ids: Optional[list[list[int]]] = None
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise RequestError(f"logit_bias must map token ids to biases, got {self.logit_bias!r}",
                                   "logit_bias")
            low, high = LOGIT_BIAS_RANGE
            bias = {}
            for token, value in self.logit_bias.items():
                if isinstance(token, str) and token.strip().isdigit():
                    token = int(token)  # JSON object keys are strings (OpenAI sends {"50256": -100})
                _require_int("logit_bias", token)
                if token < 0:
                    raise RequestError(f"logit_bias token ids must be non-negative, got {token}", "logit_bias")
                _require_finite("logit_bias", value)
                if not low <= value <= high:
                    raise RequestError(f"logit_bias values must be in [{low:g}, {high:g}], got {value} "
                                       f"for token {token}", "logit_bias")
                bias[token] = float(value)
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
                raise RequestError(f"allowed_token_ids must be a list of token ids, got {self.allowed_token_ids!r}",
                                   "allowed_token_ids")
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise RequestError("allowed_token_ids must not be empty", "allowed_token_ids")
            for t in self.allowed_token_ids:
                _require_int("allowed_token_ids", t)
                if t < 0:
                    raise RequestError(f"allowed_token_ids must be non-negative, got {t}", "allowed_token_ids")
        if self.bad_words is not None:
            if isinstance(self.bad_words, str):
                self.bad_words = [self.bad_words]
            self.bad_words = list(self.bad_words)
            for w in self.bad_words:
                if not isinstance(w, str) or not w.strip():
                    raise RequestError(f"bad_words must hold non-empty strings, got {w!r}", "bad_words")

    def _disable_truncation_for_greedy(self) -> None:
        # Truncation cannot change an argmax; resetting keeps the sampler's fast path.
        self.top_p = 1.0
        self.top_k = TOP_K_DISABLED
        self.min_p = 0.0


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrains a request's output to a grammar; exactly one kind is set (vLLM's names).
    json: a JSON schema (dict or JSON text); regex; choice: the output is one of these strings;
    grammar: an EBNF (GBNF) grammar; json_object: any JSON object; structural_tag: free text in which
    a trigger starts a tag whose content must follow a schema (a dict or JSON text, vLLM's legacy
    {"structures", "triggers"} form or xgrammar's {"format"} form; kept parsed, as a dict; see
    pagedserve.engine.structural_tag). The engine compiles it when the request is added
    (pagedserve.engine.grammar); one that does not compile is a RequestError."""

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[Any] = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise RequestError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object, "
                               "structural_tag "
                               f"(got {', '.join(kinds) if kinds else 'none'})", "structured_outputs")
        if self.structural_tag is not None:  # checked now, so a malformed tag never reaches the engine
            from pagedserve.engine import structural_tag

            object.__setattr__(self, "structural_tag", structural_tag.parse(self.structural_tag))
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise RequestError("structured_outputs.json must be a JSON schema (a dict or JSON text)",
                               "structured_outputs")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(f"structured_outputs.{name} must be a non-empty string", "structured_outputs")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise RequestError("structured_outputs.choice must be a non-empty list of non-empty strings",
                                   "structured_outputs")
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object is not None and self.json_object is not True:
            raise RequestError("structured_outputs.json_object must be true", "structured_outputs")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple:
        """A hashable key naming the compiled grammar this spec gives."""
        import json as _json

        value = getattr(self, self.kind)
        if isinstance(value, (dict, list)):
            value = _json.dumps(value, sort_keys=True)
        return (self.kind, value, self.disable_any_whitespace)


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _require_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an int, got {value!r}", name)


def _require_finite(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}", name)
