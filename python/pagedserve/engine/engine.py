"""LLMEngine: requests in, outputs out, one step at a time.

The engine owns the host side: the tokenizer, the EOS ids, the request
records and the C++ scheduler, sized from the KV plan its Worker returns.
The Worker owns the device side (model, KV cache, model runner).

One step:
    schedule (C++)
    -> launch block copies + forward + sampling on the device (Worker)
    -> while the device works: detokenize the PREVIOUS step's tokens, find stop
       strings, build its outputs (host work that would otherwise sit between
       two forwards)
    -> wait for this step's sampled ids -> update (C++): append, EOS,
       max_tokens, forks.
The tokens are recorded on their requests by the next step, once its forward
is queued (the sampling rows, penalties and grammars that read them come
next), so a decode forward follows the last with only update, schedule and
the input copy between them. So text and outputs trail the tokens by one
step; engine/sequences.py says how and why every sequence finishes.

Run-ahead (async_scheduling on): a step whose samples are final on the device
is advanced (C++) instead of waited for; the next step is scheduled and its
forward queued first, its decode inputs taken from those samples on the
device. Then, while the device runs that forward, the advanced step's tokens
are committed (C++: EOS, stop ids, max_tokens, as update() applies them) and
recorded, and only then are the new step's sampling rows and grammar masks
built, so penalties, min_tokens and grammars see every token (a step with
prompt logprobs, or with grammar rows the grammar thread does not take, is not
itself run ahead: _may_run_ahead). The grammar thread (engine/grammar_thread.py)
fills the next masks from the step's tokens while this thread records, emits
and schedules; the device waits for them before the next draw. The device no
longer waits for scheduling and input copies between steps; a row whose
sequence the commit finishes ran once more, and its token is dropped. Tokens
and logprobs are the same either way.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable, Optional, Union

import numpy as np
import torch

from pagedserve import _core
from pagedserve.engine.grammar import Grammars
from pagedserve.engine.info import EngineInfo
from pagedserve.engine.prompt_logprobs import PromptLogprobs
from pagedserve.engine.request import Request
from pagedserve.engine.sequences import REJECTED_ERROR, Sequences
from pagedserve.engine.token_recorder import TokenRecorder
from pagedserve.engine.snapshot import engine_snapshot
from pagedserve.engine.tokenizer import (PromptType, bad_words_token_ids, eos_token_ids, load_tokenizer,
                                         prompt_token_ids)
from pagedserve.engine.validation import EngineLimits, validate_request
from pagedserve.distributed.launch import make_worker
from pagedserve.engine_config import EngineConfig, resolve_defaults
from pagedserve.errors import RequestError
from pagedserve.models.default_model import model_path
from pagedserve.models.model_config import ModelConfig, check_device_usable, resolve_device
from pagedserve.outputs import RequestOutput
from pagedserve.sample.sampler import SamplerOutput
from pagedserve.sample.sampling_tensors import SamplingRow
from pagedserve.sampling_params import DEFAULT_SAMPLING, SamplingParams

logger = logging.getLogger("pagedserve")

_NO_SAMPLES = SamplerOutput(token_ids=[], logprobs=None)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class LLMEngine:
    def __init__(self, config: Optional[EngineConfig] = None, **kwargs):
        config = (config or EngineConfig()).with_updates(**kwargs)
        if config.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={config.data_parallel_size}: an LLMEngine (and LLM) is one engine "
                             f"in this process; serve replicas with `pagedserve serve --data-parallel-size "
                             f"{config.data_parallel_size}` and use its OpenAI API")
        device = check_device_usable(resolve_device(config.device))
        model_dir = model_path(config.model)
        self.model_config = ModelConfig.from_model_dir(model_dir, dtype=config.dtype, device=device)
        self.config = resolve_defaults(config, device.type, self.model_config.max_position_embeddings,
                                       checkpoint_is_bf16=self.model_config.checkpoint_dtype == torch.bfloat16)
        has_tokenizer = any((model_dir / f).exists() for f in _TOKENIZER_FILES)
        self.tokenizer = load_tokenizer(model_dir) if has_tokenizer else None
        configured_eos = self.model_config.eos_token_ids
        self.eos_token_ids = eos_token_ids(self.tokenizer, configured_eos) if self.tokenizer else list(configured_eos)
        # A Worker, or with tensor_parallel_size > 1 the driver of the ranks' group (distributed/)
        self.worker = make_worker(self.config, self.model_config, self.eos_token_ids)
        plan = self.worker.kv_plan
        self.max_model_len = plan.max_model_len
        self.scheduler = _core.Scheduler(_core.SchedulerConfig(
            num_blocks=plan.num_blocks, block_size=plan.block_size, max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens, max_model_len=plan.max_model_len,
            enable_prefix_caching=self.config.enable_prefix_caching, eos_token_ids=self.eos_token_ids,
            sliding_window=self.model_config.kv_window))  # blocks behind an all-layer window go back to the pool
        self.limits = EngineLimits(max_model_len=plan.max_model_len, max_num_seqs=self.config.max_num_seqs,
                                   max_logprobs=self.config.max_logprobs, vocab_size=self.model_config.vocab_size)
        self._model_dir = model_dir
        self.requests: dict[str, Request] = {}
        self._sequences = Sequences(self.scheduler)
        self._unscheduled: dict[int, Request] = {}  # first sequence of requests not yet scheduled
        self._unrecorded: Optional[tuple] = None  # the last step's tokens, until the next launch records them
        self._run_ahead = self.config.async_scheduling == "on"
        self._advanced: Optional[tuple] = None  # (step, PendingSamples) advanced, its tokens not committed
        self.num_prompt_tokens_total = 0
        self.num_steps_run_ahead = 0
        self.grammars = Grammars(model_dir, self.model_config.vocab_size, self.eos_token_ids,  # structured outputs
                                 self.config.max_num_seqs, pin_memory=self.worker.device.type == "cuda",
                                 backend=self.config.structured_outputs_backend,
                                 thread=self.config.structured_outputs_thread == "on")
        self._recorder = TokenRecorder(self._sequences, self.grammars, self.requests, self.tokenizer,
                                       self.worker.sampler.generator_for)
        self._prompt_logprobs = PromptLogprobs(self._recorder.logprob_entry)  # SamplingParams.prompt_logprobs

    def info(self) -> EngineInfo:
        return EngineInfo(model_name=self._model_dir.name, model_path=self._model_dir, device=str(self.worker.device),
                          dtype=str(self.model_config.dtype).removeprefix("torch."), tokenizer=self.tokenizer,
                          limits=self.limits,
                          default_sampling={**DEFAULT_SAMPLING, **self.model_config.generation_defaults},
                          architecture=self.model_config.architecture,
                          structured_outputs_backend=self.config.structured_outputs_backend)

    def default_sampling_params(self, **overrides) -> SamplingParams:
        """SamplingParams with the model's defaults (info().default_sampling) under `overrides`."""
        return SamplingParams(**{**self.info().default_sampling, **overrides})

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None, stream: bool = True) -> None:
        """Queues a request. With stream=True each step() hands back what changed
        (a delta); with stream=False one cumulative RequestOutput when it finishes.
        Raises RequestError (a ValueError) for a request the engine refuses."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id", "duplicate_id")
        text, token_ids = prompt_token_ids(self.tokenizer, prompt)
        token_ids = validate_request(token_ids, params, self.limits)
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        request = Request(request_id, text, token_ids, params, self.tokenizer, arrival_time, stream)
        self.grammars.attach(request, self.tokenizer is not None)  # compiles it: may raise RequestError
        request.samples[0].generator = self.worker.sampler.generator_for(params, 0)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(token_ids)
        seq_id = self.scheduler.add_sequence(
            np.asarray(token_ids, dtype=np.int32), max_tokens=max_tokens, min_tokens=params.min_tokens,
            ignore_eos=params.ignore_eos, stop_token_ids=list(params.stop_token_ids or []), n=params.n,
            # Prompt logprobs recompute cached positions from their KV, which a sliding window frees.
            use_prefix_cache=not (params.prompt_logprobs is not None and self.model_config.kv_window),
            cache_salt=self.model_config.prefix_cache_salt(len(token_ids)))
        self.requests[request_id] = request
        self._sequences.own(seq_id, request, 0)
        self._unscheduled[seq_id] = request
        self._prompt_logprobs.add(seq_id, request)
        self.num_prompt_tokens_total += len(token_ids)

    def abort_request(self, request_id: Union[str, Iterable[str]]) -> list[RequestOutput]:
        """Drops requests; their KV blocks return to the pool at once. Returns the outputs that end
        the ones still unfinished (finish_reason "abort"); step() hands back nothing more for them."""
        finals = []
        self._catch_up()  # the tokens sampled last belong in the final outputs
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            request = self.requests.pop(rid, None)
            self._recorder.forget(rid)
            if request is None:
                continue
            for sample in request.samples:
                self._unscheduled.pop(sample.seq_id, None)
                self._sequences.stop(sample, _core.FinishReason.ABORT)
                sample.finish("abort")
            request.metrics.finished_time = time.monotonic()
            out = request.output()
            if out is not None:
                finals.append(out)
        return finals

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the outputs it produced (see add_request's `stream`)."""
        out = self.scheduler.schedule()
        self._note_schedule(out)
        matchers: list = []  # (row, grammar) of the step's constrained rows, filled by the launch
        pending = self._launch(out, matchers) if out.num_seqs else None
        self._catch_up()  # the last step's tokens, while the device runs this one, if the launch did not
        outputs = self._recorder.emit()  # overlaps the device's work on this step
        if pending is not None and self._may_run_ahead(out, pending, matchers):
            self.scheduler.advance()
            self._advanced = (out, pending)
            self.num_steps_run_ahead += 1
        else:
            sampled = pending.result() if pending is not None else _NO_SAMPLES
            self._prompt_logprobs.record(pending)
            result = self.scheduler.update(np.asarray(sampled.token_ids, dtype=np.int32))
            self._unrecorded = (out, sampled, result, time.monotonic())
        if not self.scheduler.has_unfinished():
            self._catch_up()  # a step whose every row was stopped or aborted meanwhile
            outputs += self._recorder.emit()  # nothing left to overlap with
        return outputs

    def _may_run_ahead(self, out, pending, matchers: list) -> bool:
        """Whether the next step may be scheduled before this one's tokens reach the host: run-ahead is on,
        no prompt forks here (update() makes the children), the samples are final on the device, the step
        computed no prompt logprobs (the next plan counts recorded positions), and any grammar rows are the
        grammar thread's (it takes the tokens of this step's draw). With the masks filled on this thread,
        grammar steps run ahead were exact but slower on an H200 (64 rows, SmolLM2: JSON schema 28.3k -> 26.2k
        tok/s, tools auto 38.1k -> 31.8k; bench/results/h200/session31.md), so those keep the plain order."""
        grammars_allow = not matchers or self.grammars.thread_takes_step
        return (self._run_ahead and grammars_allow and pending.device_ids is not None
                and out.total_samples == len(out.sample_rows) and self._prompt_logprobs.idle)

    def _catch_up(self) -> None:
        """Every step's tokens into the scheduler and onto the requests (waiting for an advanced step's)."""
        self._commit_advanced()
        self._record_last_step()

    def _commit_advanced(self) -> None:
        """The advanced step's tokens into the scheduler (waiting for them); recorded with the next record."""
        if self._advanced is None:
            return
        (out, pending), self._advanced = self._advanced, None
        self._record_last_step()
        sampled = pending.result()
        self._prompt_logprobs.record(pending)
        result = self.scheduler.commit(np.asarray(sampled.token_ids, dtype=np.int32))
        self._unrecorded = (out, sampled, result, time.monotonic())

    def _record_last_step(self) -> None:
        if self._unrecorded is not None:
            last, self._unrecorded = self._unrecorded, None
            self._recorder.record(*last)

    def _note_schedule(self, out) -> None:
        now = time.monotonic()
        for rejected in out.rejected:
            self._unscheduled.pop(rejected.seq_id, None)
            self._recorder.changed(self._sequences.ended(rejected.seq_id, rejected.reason, error=REJECTED_ERROR))
        for seq_id in out.preempted:
            owner = self._sequences.get(seq_id)
            if owner is not None:
                owner[0].metrics.num_preemptions += 1
        if self._unscheduled:  # first schedules: the row's first position is how many prompt tokens were cached
            qsl, positions = out.query_start_loc, out.positions
            for row, seq_id in enumerate(out.seq_ids.tolist()):  # a one-token prefill sits among the decodes
                request = self._unscheduled.pop(seq_id, None)
                if request is not None:
                    request.metrics.first_scheduled_time = now
                    request.num_cached_tokens = int(positions[qsl[row]])

    def _launch(self, out, matchers: list):
        """The step on the device; its sampling rows and their grammars are made once the forward is
        queued (on CUDA while the device runs it: at 64 rows ~0.1 ms of Python kept off the gap between forwards).
        The (row, grammar) pairs of the constrained rows are added to `matchers`."""
        rows = lambda: self._sampling_rows(out, matchers)  # noqa: E731
        grammar = lambda: self.grammars.step(matchers)  # noqa: E731
        last_ids = self._advanced[1].device_ids if self._advanced is not None else None  # read on the device
        return self.worker.execute_async(out, rows, grammar, self._prompt_logprobs.plan(out), last_ids)

    def _sampling_rows(self, out, matchers: list) -> list:
        """The step's SamplingRows; (row, matcher) of the rows under a grammar are added to `matchers`."""
        # Run-ahead: the forward is queued, so the last step's tokens may be awaited; the rows' samples,
        # penalties and grammars take them.
        self._catch_up()
        rows = []
        seq_ids = out.seq_ids.tolist()  # plain ints: a numpy scalar per row costs more than the lookup
        for row, n in zip(out.sample_rows.tolist(), out.num_samples.tolist()):
            owner = self._sequences.get(seq_ids[row])
            if owner is None:  # stopped by that record (its grammar ended): the row's token is dropped
                rows.append(SamplingRow(SamplingParams(temperature=0.0), n, (), ()))
                continue
            request, index = owner
            grammar = request.samples[index].grammar
            if grammar is not None:
                matchers.append((len(rows), grammar))
            rows.append(request.sampling_row(index, n))
        return rows

    # ------------------------------------------------------------------ helpers
    def check_health(self) -> None:
        """Raises EngineDeadError when a process this engine depends on died or hung (a tensor-parallel
        rank; the server asks while idle)."""
        self.worker.check_health()

    def shutdown(self) -> None:
        """Aborts what is left, stops the tensor-parallel ranks and frees the device memory (weights, KV
        cache, CUDA graphs) now, rather than whenever the garbage collector gets to it."""
        self.abort_request(list(self.requests))
        self.grammars.close()
        device = self.worker.device
        self.worker.close()
        del self.worker
        self.scheduler = None
        import gc
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def stats(self) -> dict:
        s = self.scheduler.stats()
        s["num_prompt_tokens_total"] = self.num_prompt_tokens_total
        s["num_generation_tokens_total"] = self._recorder.num_generation_tokens_total
        s["num_steps_run_ahead"] = self.num_steps_run_ahead
        return s

    def snapshot(self) -> dict:
        """The engine page's view: stats, block map, running and waiting requests."""
        return engine_snapshot(self.scheduler, self._sequences, self.requests, self.stats())
