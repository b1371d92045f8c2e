"""Request: the engine's record of one request and its n samples.

The scheduler knows sequences (token ids and blocks); a Request adds what
only Python handles: text, incremental detokenization, stop strings,
logprobs, finish reasons, timing, and the delta each step adds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from pagedserve.detokenizer import IncrementalDetokenizer
from pagedserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.stop_strings import StopMatch, StopStringStream


@dataclass
class Sample:
    """One of a request's n completions, i.e. one scheduler sequence."""

    index: int
    detokenizer: Optional[IncrementalDetokenizer]
    stop_stream: Optional[StopStringStream]  # holds back text that may become a stop string
    generator: Optional[torch.Generator] = None  # a seeded request's noise source for this sample
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None
    # What the current step added, drained by Request.take_delta().
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    changed: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        if self.finished:
            return
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.changed = True

    def add_token(self, token: int) -> Optional[StopMatch]:
        """Appends a sampled token and its text; returns the stop string it completed, if any."""
        self.token_ids.append(token)
        self.new_token_ids.append(token)
        self.changed = True
        if self.detokenizer is None:
            return None
        return self._add_text(self.detokenizer.step([token]))

    def release_tail(self) -> None:
        """At a finish other than a stop string: hands out the text held back so far."""
        if self.detokenizer is None or self.finished:
            return
        if self._add_text(self.detokenizer.flush()) is None and self.stop_stream is not None:
            self._emit(self.stop_stream.flush())

    def _add_text(self, text: str) -> Optional[StopMatch]:
        if self.stop_stream is None:
            self._emit(text)
            return None
        delta = self.stop_stream.feed(text)
        self._emit(delta.text)
        return delta.match

    def _emit(self, text: str) -> None:
        self.text += text
        self.new_text += text


class Request:
    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer, arrival_time: Optional[float] = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.metrics = RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        self.num_cached_tokens = 0
        self.error: Optional[str] = None
        self.samples = [self._new_sample(i, tokenizer) for i in range(params.n)]

    def _new_sample(self, index: int, tokenizer) -> Sample:
        p = self.params
        detok = stream = None
        if tokenizer is not None:
            detok = IncrementalDetokenizer(tokenizer, self.prompt_token_ids, skip_special_tokens=p.skip_special_tokens)
            if p.stop:
                stream = StopStringStream([p.stop] if isinstance(p.stop, str) else p.stop,
                                          p.include_stop_str_in_output)
        want_logprobs = p.logprobs is not None
        return Sample(index=index, detokenizer=detok, stop_stream=stream, logprobs=[] if want_logprobs else None,
                      cumulative_logprob=0.0 if want_logprobs else None)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def output_token_ids(self, index: int) -> list[int]:
        return self.samples[index].token_ids

    def take_delta(self) -> Optional[RequestOutput]:
        """The RequestOutput holding what changed since the last call, or None."""
        changed = [s for s in self.samples if s.changed]
        if not changed:
            return None
        outputs = []
        for s in changed:
            outputs.append(CompletionOutput(
                index=s.index, text=s.new_text, token_ids=s.new_token_ids,
                cumulative_logprob=s.cumulative_logprob,
                logprobs=s.new_logprobs if s.logprobs is not None else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason))
            s.new_token_ids, s.new_text, s.new_logprobs, s.changed = [], "", [], False
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=outputs, finished=self.finished, metrics=self.metrics, error=self.error,
                             num_cached_tokens=self.num_cached_tokens)

    def final_output(self) -> RequestOutput:
        """The whole request as one cumulative RequestOutput."""
        outputs = [CompletionOutput(index=s.index, text=s.text, token_ids=list(s.token_ids),
                                    cumulative_logprob=s.cumulative_logprob, logprobs=s.logprobs,
                                    finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                   for s in self.samples]
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=outputs, finished=self.finished, metrics=self.metrics, error=self.error,
                             num_cached_tokens=self.num_cached_tokens)
