"""Request outputs, named as vLLM names them so users can switch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# Per generated token: {token_id: Logprob} holding the sampled token and the top-N.
SampleLogprobs = list[dict[int, Logprob]]


def logprob_entry(lp, tokenizer=None) -> dict[int, Logprob]:
    """One token's {token_id: Logprob} from the sampler's TokenLogprobs `lp`: the sampled token with its
    rank, then the top-N (ranks from 1) unless already there; decoded_token set when there is a tokenizer."""
    decode = tokenizer.decode if tokenizer is not None else (lambda ids: None)
    entry = {lp.token_id: Logprob(lp.logprob, lp.rank, decode([lp.token_id]))}
    for rank, (tid, value) in enumerate(lp.top, start=1):
        entry.setdefault(tid, Logprob(value, rank, decode([tid])))
    return entry


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> Optional[float]:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> Optional[float]:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: Optional[str] = None  # set when the engine rejected the request after accepting it
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: None for the first prompt token, then {token_id: Logprob} per prompt
    # token (the token itself and the top-N). A stream hands them back with its first output only.
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = field(default=None, repr=False)
