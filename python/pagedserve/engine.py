"""LLMEngine: requests in, per-step output deltas out.

One step = schedule (C++) -> block copies + forward + sample (ModelRunner)
-> update (C++) -> detokenize, stop strings, outputs (here).
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
from pagedserve.sampler import SamplingRow
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


class LLMEngine:
    def __init__(self, config: Optional[EngineConfig] = None, **kwargs):
        self.config = (config or EngineConfig()).with_updates(**kwargs)
        self.worker = Worker(self.config)
        self.tokenizer = self.worker.tokenizer
        self.model_config = self.worker.model_config
        self.max_model_len = self.worker.max_model_len
        self.scheduler = self.worker.scheduler
        self.requests: dict[str, Request] = {}
        self._seq_owner: dict[int, tuple[Request, int]] = {}  # seq id -> (request, sample index)
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        self._validate(token_ids, params)
        request = Request(request_id, text, token_ids, params, self.tokenizer, arrival_time)
        request.samples[0].generator = self.worker.sampler.generator_for(params, 0)
        seq_id = self.scheduler.add_sequence(
            np.asarray(token_ids, dtype=np.int32), max_tokens=self._max_tokens(token_ids, params),
            min_tokens=params.min_tokens,
            ignore_eos=params.ignore_eos, stop_token_ids=list(params.stop_token_ids or []), n=params.n)
        self.requests[request_id] = request
        self._seq_owner[seq_id] = (request, 0)
        self.num_prompt_tokens_total += len(token_ids)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            for seq_id, (owner, index) in list(self._seq_owner.items()):
                if owner is request:
                    self.scheduler.abort(seq_id)
                    del self._seq_owner[seq_id]
            for sample in request.samples:
                sample.finish("abort")
            request.metrics.finished_time = time.monotonic()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Runs one step; returns a delta RequestOutput for each request it changed."""
        out = self.scheduler.schedule()
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for rejected in out.rejected:
            self._finish_seq(rejected.seq_id, rejected.reason, None, touched,
                             error="the request does not fit in the KV cache")
        for seq_id in out.preempted:
            if seq_id in self._seq_owner:
                self._seq_owner[seq_id][0].metrics.num_preemptions += 1
        sampled_ids: list[int] = []
        logprobs = None
        if out.num_seqs:
            self._mark_scheduled(out, now)
            rows, row_seqs = self._sampling_rows(out)
            sampler_out = self.worker.execute(out, rows)
            sampled_ids, logprobs = sampler_out.token_ids, sampler_out.logprobs
        result = self.scheduler.update(np.asarray(sampled_ids, dtype=np.int32))
        children = {(f.parent, f.sample_index): f.child for f in result.forks}
        for f in result.forks:
            request, _ = self._seq_owner[f.parent]
            self._seq_owner[f.child] = (request, f.sample_index)
            request.samples[f.sample_index].generator = self.worker.sampler.generator_for(request.params,
                                                                                          f.sample_index)
        now = time.monotonic()
        k = 0
        for r, row in enumerate(out.sample_rows):
            parent = int(out.seq_ids[row])
            for j in range(int(out.num_samples[r])):
                seq_id = parent if j == 0 else children.get((parent, j))
                self._append_token(seq_id, sampled_ids[k], logprobs[k] if logprobs else None, now, touched)
                k += 1
        for f in result.finished:
            self._finish_seq(f.seq_id, f.reason, f.stop_token, touched)
        return self._collect(touched)

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

    def _mark_scheduled(self, out, now: float) -> None:
        for seq_id in out.seq_ids:
            owner = self._seq_owner.get(int(seq_id))
            if owner and owner[0].metrics.first_scheduled_time is None:
                owner[0].metrics.first_scheduled_time = now

    def _sampling_rows(self, out) -> tuple[list[SamplingRow], list[int]]:
        rows, row_seqs = [], []
        for r, row in enumerate(out.sample_rows):
            seq_id = int(out.seq_ids[row])
            request, index = self._seq_owner[seq_id]
            rows.append(SamplingRow(params=request.params, num_samples=int(out.num_samples[r]),
                                    prompt_token_ids=request.prompt_token_ids,
                                    output_token_ids=request.samples[index].token_ids,
                                    generator=request.samples[index].generator))
            row_seqs.append(seq_id)
        return rows, row_seqs

    def _append_token(self, seq_id: Optional[int], token: int, logprob, now: float,
                      touched: dict[str, Request]) -> None:
        owner = self._seq_owner.get(seq_id) if seq_id is not None else None
        if owner is None:
            return  # aborted while its step ran
        request, index = owner
        sample = request.samples[index]
        if sample.finished:
            return
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        request.metrics.last_token_time = now
        self.num_generation_tokens_total += 1
        touched[request.request_id] = request
        if logprob is not None and sample.logprobs is not None:
            entry = self._logprob_entry(logprob)
            sample.logprobs.append(entry)
            sample.new_logprobs.append(entry)
            sample.cumulative_logprob += logprob.logprob
        stop = sample.add_token(token)
        if stop is not None:
            self.scheduler.finish(seq_id, _core.FinishReason.STOP)
            sample.finish("stop", stop.stop)
            self._retire(seq_id, request)

    def _logprob_entry(self, lp) -> dict[int, Logprob]:
        decode = self.tokenizer.decode if self.tokenizer is not None else (lambda ids: None)
        entry = {lp.token_id: Logprob(lp.logprob, lp.rank, decode([lp.token_id]))}
        for rank, (tid, value) in enumerate(lp.top, start=1):
            entry.setdefault(tid, Logprob(value, rank, decode([tid])))
        return entry

    def _finish_seq(self, seq_id: int, reason, stop_token: Optional[int], touched: dict[str, Request],
                    error: Optional[str] = None) -> None:
        owner = self._seq_owner.get(seq_id)
        if owner is None:
            return
        request, index = owner
        sample = request.samples[index]
        sample.release_tail()
        stop_reason = None
        if reason == _core.FinishReason.STOP and stop_token is not None and \
                stop_token in (request.params.stop_token_ids or []):
            stop_reason = stop_token
        sample.finish(_FINISH_REASONS[reason], stop_reason)
        if error:
            request.error = error
        touched[request.request_id] = request
        self._retire(seq_id, request)

    def _retire(self, seq_id: int, request: Request) -> None:
        self._seq_owner.pop(seq_id, None)
        if request.finished:
            request.metrics.finished_time = time.monotonic()

    def _collect(self, touched: dict[str, Request]) -> list[RequestOutput]:
        outputs = []
        for rid, request in touched.items():
            delta = request.take_delta()
            if delta is not None:
                outputs.append(delta)
            if request.finished:
                self.requests.pop(rid, None)
        return outputs

    # ------------------------------------------------------------------ introspection
    def request_id_of(self, seq_id: int) -> Optional[str]:
        """The request a scheduler sequence belongs to; None once it finished or was aborted."""
        owner = self._seq_owner.get(int(seq_id))
        return owner[0].request_id if owner is not None else None

    def stats(self) -> dict:
        s = self.scheduler.stats()
        s["num_prompt_tokens_total"] = self.num_prompt_tokens_total
        s["num_generation_tokens_total"] = self.num_generation_tokens_total
        return s
