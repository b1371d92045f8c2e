"""Request: the engine's record of one request and its n samples.

The scheduler knows sequences (token ids and blocks); a Request adds what
only Python handles: text, incremental detokenization, stop strings,
logprobs, finish reasons, timing, and the outputs handed back.

Tokens arrive in two phases (see engine.py): `add_token` records a sampled
token at once (cheap, needed by the next step's sampler), and `sync_text`
later turns the tokens into text while the GPU runs the next step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedserve.sample.sampler import SamplingRow
from pagedserve.sampling_params import SamplingParams
from pagedserve.engine.stop_strings import StopMatch, StopStringStream


@dataclass
class Sample:
    """One of a request's n completions, i.e. one scheduler sequence."""

    index: int
    detokenizer: Optional[IncrementalDetokenizer]
    stop_stream: Optional[StopStringStream]  # holds back text that may become a stop string
    incremental: bool  # detokenize every step (streaming or stop strings) rather than once at the end
    seq_id: Optional[int] = None  # its scheduler sequence while that lives
    generator: Optional[torch.Generator] = None  # a seeded request's noise source for this sample
    row: Optional[SamplingRow] = None  # what the sampler needs, built once
    grammar: Optional[Any] = None  # its xgrammar GrammarMatcher (structured outputs; engine/grammar.py)
    token_ids: list[int] = field(default_factory=list)
    num_detokenized: int = 0
    text: str = ""
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None
    ending: Optional[tuple[str, int | str | None]] = None  # the scheduler's finish, applied by sync_text
    # What changed since the last delta, drained by Request.take_delta().
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    changed: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def done(self) -> bool:
        """No more tokens will come (finished, or finishing at the next sync_text)."""
        return self.finished or self.ending is not None

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        if self.finished:
            return
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.changed = True

    def add_token(self, token: int, logprob: Optional[dict[int, Logprob]], chosen_logprob: float) -> None:
        self.token_ids.append(token)
        self.new_token_ids.append(token)
        self.changed = True
        if logprob is not None and self.logprobs is not None:
            self.logprobs.append(logprob)
            self.new_logprobs.append(logprob)
            self.cumulative_logprob += chosen_logprob

    def sync_text(self) -> Optional[StopMatch]:
        """Detokenizes the tokens that arrived since the last call (every step when
        incremental, else once when the sample ends) and applies a pending finish.
        Returns the stop string that ended the sample, if one did."""
        if self.finished:
            return None
        stop = None
        if self.detokenizer is not None and (self.incremental or self.ending is not None):
            new_ids = self.token_ids[self.num_detokenized:]
            self.num_detokenized = len(self.token_ids)
            stop = self._add_text(self.detokenizer.step(new_ids)) if new_ids else None
            if stop is None and self.ending is not None:
                stop = self._add_text(self.detokenizer.flush())
                if stop is None and self.stop_stream is not None:
                    self._emit(self.stop_stream.flush())
        if stop is not None:
            self.finish("stop", stop.stop)
        elif self.ending is not None:
            self.finish(*self.ending)
        return stop

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
                 tokenizer, arrival_time: Optional[float] = None, stream: bool = True):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.stream = stream  # hand back a delta every step; else one cumulative output at the end
        self.metrics = RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        self.num_cached_tokens = 0
        self.error: Optional[str] = None
        # None first, then {token_id: Logprob} per prompt token (engine/prompt_logprobs.py); None: not asked.
        self.prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
        self._prompt_logprobs_sent = False  # a stream hands them back once, with its first output
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
        return Sample(index=index, detokenizer=detok, stop_stream=stream, incremental=self.stream or stream is not None,
                      logprobs=[] if want_logprobs else None, cumulative_logprob=0.0 if want_logprobs else None)

    def sampling_row(self, index: int, num_samples: int) -> SamplingRow:
        """The sampler's view of sample `index`, built once (the fork row, n samples, is built fresh)."""
        sample = self.samples[index]
        if num_samples != 1:
            return SamplingRow(self.params, num_samples, self.prompt_token_ids, sample.token_ids, sample.generator)
        if sample.row is None:
            sample.row = SamplingRow(self.params, 1, self.prompt_token_ids, sample.token_ids, sample.generator)
        return sample.row

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def output(self) -> Optional[RequestOutput]:
        """What to hand back now: a delta when streaming, the whole request once it finished otherwise."""
        if self.stream:
            return self.take_delta()
        return self.final_output() if self.finished else None

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
        prompt_logprobs = None if self._prompt_logprobs_sent else self.prompt_logprobs
        self._prompt_logprobs_sent = True
        return self._request_output(outputs, prompt_logprobs)

    def final_output(self) -> RequestOutput:
        """The whole request as one cumulative RequestOutput."""
        return self._request_output([
            CompletionOutput(index=s.index, text=s.text, token_ids=list(s.token_ids),
                             cumulative_logprob=s.cumulative_logprob, logprobs=s.logprobs,
                             finish_reason=s.finish_reason, stop_reason=s.stop_reason)
            for s in self.samples], self.prompt_logprobs)

    def _request_output(self, outputs: list[CompletionOutput], prompt_logprobs=None) -> RequestOutput:
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=outputs, finished=self.finished, metrics=self.metrics, error=self.error,
                             num_cached_tokens=self.num_cached_tokens, prompt_logprobs=prompt_logprobs)
