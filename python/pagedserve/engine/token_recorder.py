"""TokenRecorder: a step's results onto the requests, then the outputs they make.

record() puts the tokens update() or commit() accepted on their samples (with
logprobs, the children of forked prompts, grammar matchers) and the scheduler's
finishes on their sequences; emit() turns what changed into text, finds stop
strings (stopping those sequences in the scheduler) and hands back the
RequestOutputs, dropping finished requests from the engine's table.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from pagedserve.engine.grammar import Grammars
from pagedserve.engine.request import Request
from pagedserve.engine.sequences import Sequences
from pagedserve.outputs import Logprob, RequestOutput, logprob_entry
from pagedserve.sample.sampler import SamplerOutput


class TokenRecorder:
    def __init__(self, sequences: Sequences, grammars: Grammars, requests: dict[str, Request], tokenizer,
                 generator_for: Callable):
        """requests: the engine's table of unfinished requests (emit() removes the finished);
        generator_for: the sampler's per-sample generator maker, for forked children."""
        self._sequences = sequences
        self._grammars = grammars
        self._requests = requests
        self._tokenizer = tokenizer
        self._generator_for = generator_for
        self._changed: dict[str, Request] = {}  # requests with tokens or finishes not yet turned into outputs
        self.num_generation_tokens_total = 0

    def logprob_entry(self, lp) -> dict[int, Logprob]:
        return logprob_entry(lp, self._tokenizer)

    def changed(self, request: Optional[Request]) -> None:
        """Marks a request for the next emit()."""
        if request is not None:
            self._changed[request.request_id] = request

    def forget(self, request_id: str) -> None:
        self._changed.pop(request_id, None)

    def record(self, out, sampled: SamplerOutput, result, now: float) -> None:
        """The step's tokens that update() or commit() accepted onto their samples (`now`: when they reached
        the host); `result`'s forks and finishes onto the sequences. Grammars the grammar thread ended
        since the last record end their sequences first: this step's tokens came after their end."""
        self._stop_ended_grammars()
        children = {}
        for f in result.forks:
            request, _ = self._sequences[f.parent]
            self._sequences.own(f.child, request, f.sample_index)
            request.samples[f.sample_index].generator = self._generator_for(request.params, f.sample_index)
            children[(f.parent, f.sample_index)] = f.child
        seq_ids, tokens, logprobs, k = out.seq_ids.tolist(), sampled.token_ids, sampled.logprobs, 0
        for row, n in zip(out.sample_rows.tolist(), out.num_samples.tolist()):
            parent = seq_ids[row]
            for j in range(n):
                owner = self._sequences.get(parent if j == 0 else children.get((parent, j), -1))
                if owner is not None:
                    self._add_token(owner, tokens[k], logprobs[k] if logprobs else None, now)
                k += 1
        self.num_generation_tokens_total += k
        for f in result.finished:
            self.changed(self._sequences.ended(f.seq_id, f.reason, f.stop_token))
        self._stop_ended_grammars()

    def _stop_ended_grammars(self) -> None:
        for request, sample in self._grammars.take_ended():  # a grammar that terminated ends its sequence
            self._sequences.stop(sample)
            self.changed(request)

    def _add_token(self, owner: tuple[Request, int], token: int, logprob, now: float) -> None:
        request, index = owner
        sample = request.samples[index]
        if sample.done:
            return  # a stop string ended it while this step ran
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        entry = self.logprob_entry(logprob) if logprob is not None and sample.logprobs is not None else None
        sample.add_token(token, entry, logprob.logprob if entry else 0.0)
        if sample.grammar is not None:
            self._grammars.accept(request, sample, token)
        if sample.incremental:  # others get their text once, when they end
            self.changed(request)

    def emit(self) -> list[RequestOutput]:
        """Text, stop strings and finishes for the tokens recorded so far; the outputs they make."""
        outputs = []
        for rid, request in self._changed.items():
            for sample in request.samples:
                if sample.sync_text() is not None:  # a stop string: the sequence may still be running
                    self._sequences.stop(sample)
            out = request.output()
            if out is not None:
                outputs.append(out)
            if request.finished:
                request.metrics.finished_time = time.monotonic()
                self._requests.pop(rid, None)
        self._changed.clear()
        return outputs
