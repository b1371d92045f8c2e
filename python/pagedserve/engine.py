"""LLMEngine: requests in, outputs out, one step at a time.

One step:
    schedule (C++)
    -> launch block copies + forward + sampling on the device (ModelRunner)
    -> while the device works: detokenize the PREVIOUS step's tokens, find stop
       strings, build its outputs (host work that would otherwise sit between
       two forwards)
    -> wait for this step's sampled ids -> update (C++): append, EOS,
       max_tokens, forks -> record the tokens on their requests.
So text and outputs trail the tokens by one step; a stop string found then
finishes its sequence, and the token it sampled meanwhile is dropped.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable, Optional, Union

import numpy as np

from pagedserve import _core
from pagedserve.engine_config import EngineConfig
from pagedserve.outputs import Logprob, RequestOutput
from pagedserve.request import Request
from pagedserve.sampler import SamplerOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker import Worker

logger = logging.getLogger("pagedserve")

PromptType = Union[str, list[int], dict]

_FINISH_REASONS = {
    _core.FinishReason.STOP: "stop",
    _core.FinishReason.LENGTH: "length",
    _core.FinishReason.ABORT: "abort",
    _core.FinishReason.REJECTED: "length",
}
_NO_SAMPLES = SamplerOutput(token_ids=[], logprobs=None)


class LLMEngine:
    def __init__(self, config: Optional[EngineConfig] = None, **kwargs):
        self.config = (config or EngineConfig()).with_updates(**kwargs)
        self.worker = Worker(self.config)
        self.tokenizer = self.worker.tokenizer
        self.model_config = self.worker.model_config
        self.max_model_len = self.worker.max_model_len
        self.scheduler = self.worker.scheduler
        self.requests: dict[str, Request] = {}
        self._seq_owner: dict[int, tuple[Request, int]] = {}  # live seq id -> (request, sample index)
        self._untexted: dict[str, Request] = {}  # requests with tokens or finishes not yet turned into outputs
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None, stream: bool = True) -> None:
        """Queues a request. With stream=True each step() hands back what changed
        (a delta); with stream=False one cumulative RequestOutput when it finishes."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        self._validate(token_ids, params)
        request = Request(request_id, text, token_ids, params, self.tokenizer, arrival_time, stream)
        request.samples[0].generator = self.worker.sampler.generator_for(params, 0)
        seq_id = self.scheduler.add_sequence(
            np.asarray(token_ids, dtype=np.int32), max_tokens=self._max_tokens(token_ids, params),
            min_tokens=params.min_tokens, ignore_eos=params.ignore_eos,
            stop_token_ids=list(params.stop_token_ids or []), n=params.n)
        self.requests[request_id] = request
        self._own(seq_id, request, 0)
        self.num_prompt_tokens_total += len(token_ids)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Drops requests; their KV blocks return to the pool at once. No output follows."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            request = self.requests.pop(rid, None)
            self._untexted.pop(rid, None)
            if request is None:
                continue
            for sample in request.samples:
                self._release_seq(sample, _core.FinishReason.ABORT)
                sample.finish("abort")
            request.metrics.finished_time = time.monotonic()

    def _own(self, seq_id: int, request: Request, index: int) -> None:
        self._seq_owner[seq_id] = (request, index)
        request.samples[index].seq_id = seq_id

    def _release_seq(self, sample, reason) -> None:
        """Finishes the sample's sequence in the scheduler now (its blocks return at once)."""
        if sample.seq_id is not None and self._seq_owner.pop(sample.seq_id, None) is not None:
            self.scheduler.finish(sample.seq_id, reason)
        sample.seq_id = None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def request_id_of(self, seq_id: int) -> Optional[str]:
        """The request a scheduler sequence belongs to; None once it finished or was aborted."""
        owner = self._seq_owner.get(int(seq_id))
        return owner[0].request_id if owner is not None else None

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the outputs it produced (see add_request's `stream`)."""
        out = self.scheduler.schedule()
        self._note_schedule(out)
        pending = self.worker.execute_async(out, self._sampling_rows(out)) if out.num_seqs else None
        outputs = self._emit_outputs()  # overlaps the device's work on this step
        sampled = pending.result() if pending is not None else _NO_SAMPLES
        result = self.scheduler.update(np.asarray(sampled.token_ids, dtype=np.int32))
        self._record_tokens(out, sampled, result)
        if not self.scheduler.has_unfinished():
            outputs += self._emit_outputs()  # nothing left to overlap with
        return outputs

    def _note_schedule(self, out) -> None:
        now = time.monotonic()
        for rejected in out.rejected:
            self._end_seq(rejected.seq_id, rejected.reason, None, error="the request does not fit in the KV cache")
        for seq_id in out.preempted:
            if seq_id in self._seq_owner:
                self._seq_owner[seq_id][0].metrics.num_preemptions += 1
        for seq_id in out.seq_ids[out.num_decodes:].tolist():  # a first schedule is never a decode
            owner = self._seq_owner.get(seq_id)
            if owner and owner[0].metrics.first_scheduled_time is None:
                owner[0].metrics.first_scheduled_time = now

    def _sampling_rows(self, out) -> list:
        seq_ids = out.seq_ids
        rows = []
        for row, n in zip(out.sample_rows.tolist(), out.num_samples.tolist()):
            request, index = self._seq_owner[int(seq_ids[row])]
            rows.append(request.sampling_row(index, n))
        return rows

    def _record_tokens(self, out, sampled: SamplerOutput, result) -> None:
        """update()'s tokens onto their samples: cheap bookkeeping the next step's sampler needs."""
        children = {}
        for f in result.forks:
            request, _ = self._seq_owner[f.parent]
            self._own(f.child, request, f.sample_index)
            request.samples[f.sample_index].generator = self.worker.sampler.generator_for(request.params,
                                                                                          f.sample_index)
            children[(f.parent, f.sample_index)] = f.child
        now = time.monotonic()
        seq_ids, logprobs, k = out.seq_ids, sampled.logprobs, 0
        for row, n in zip(out.sample_rows.tolist(), out.num_samples.tolist()):
            parent = int(seq_ids[row])
            for j in range(n):
                seq_id = parent if j == 0 else children.get((parent, j))
                owner = self._seq_owner.get(seq_id)
                if owner is not None:
                    self._add_token(owner, sampled.token_ids[k], logprobs[k] if logprobs else None, now)
                k += 1
        self.num_generation_tokens_total += k
        for f in result.finished:
            self._end_seq(f.seq_id, f.reason, f.stop_token)

    def _add_token(self, owner: tuple[Request, int], token: int, logprob, now: float) -> None:
        request, index = owner
        sample = request.samples[index]
        if sample.done:
            return  # a stop string ended it while this step ran
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        entry = self._logprob_entry(logprob) if logprob is not None and sample.logprobs is not None else None
        sample.add_token(token, entry, logprob.logprob if entry else 0.0)
        if sample.incremental:  # others get their text once, when they end (see _end_seq)
            self._untexted[request.request_id] = request

    def _end_seq(self, seq_id: int, reason, stop_token: Optional[int], error: Optional[str] = None) -> None:
        """The scheduler finished a sequence: its sample ends at the next _emit_outputs."""
        owner = self._seq_owner.pop(seq_id, None)
        if owner is None:
            return
        request, index = owner
        request.samples[index].seq_id = None
        stop_reason = stop_token if stop_token is not None and stop_token in (request.params.stop_token_ids or []) \
            else None
        request.samples[index].ending = (_FINISH_REASONS[reason], stop_reason)
        if error:
            request.error = error
        self._untexted[request.request_id] = request

    def _emit_outputs(self) -> list[RequestOutput]:
        """Text, stop strings and finishes for the tokens recorded so far; the outputs they make."""
        outputs = []
        for rid, request in self._untexted.items():
            for sample in request.samples:
                if sample.sync_text() is not None:  # a stop string: the sequence may still be running
                    self._release_seq(sample, _core.FinishReason.STOP)
            out = request.output()
            if out is not None:
                outputs.append(out)
            if request.finished:
                request.metrics.finished_time = time.monotonic()
                self.requests.pop(rid, None)
        self._untexted.clear()
        return outputs

    # ------------------------------------------------------------------ helpers
    def _tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer: pass prompt token ids")
            return prompt, self.worker.encode(prompt)
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, [int(t) for t in prompt]
        raise TypeError(f"a prompt is a string, a list of token ids or a dict, not {type(prompt).__name__}")

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        total = len(token_ids) + (params.max_tokens or 1)
        if total > self.max_model_len:
            raise ValueError(f"the prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) is "
                             f"{total} tokens, more than max_model_len ({self.max_model_len})")
        if params.n > self.scheduler.config.max_num_seqs:
            raise ValueError(f"n={params.n} is more than max_num_seqs ({self.scheduler.config.max_num_seqs})")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} is more than max_logprobs ({self.config.max_logprobs})")

    def _max_tokens(self, token_ids: list[int], params: SamplingParams) -> int:
        return params.max_tokens if params.max_tokens is not None else self.max_model_len - len(token_ids)

    def _logprob_entry(self, lp) -> dict[int, Logprob]:
        decode = self.tokenizer.decode if self.tokenizer is not None else (lambda ids: None)
        entry = {lp.token_id: Logprob(lp.logprob, lp.rank, decode([lp.token_id]))}
        for rank, (tid, value) in enumerate(lp.top, start=1):
            entry.setdefault(tid, Logprob(value, rank, decode([tid])))
        return entry

    def shutdown(self) -> None:
        """Aborts what is left and frees the device memory (weights, KV cache, CUDA graphs) now,
        rather than whenever the garbage collector gets to it."""
        self.abort_request(list(self.requests))
        device = self.worker.device
        del self.worker
        self.scheduler = None
        import gc
        gc.collect()
        if device.type == "cuda":
            import torch
            torch.cuda.empty_cache()

    def stats(self) -> dict:
        s = self.scheduler.stats()
        s["num_prompt_tokens_total"] = self.num_prompt_tokens_total
        s["num_generation_tokens_total"] = self.num_generation_tokens_total
        return s
