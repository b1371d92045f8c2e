"""DataParallelEngine: N engine replicas, each in a process of its own, presented to the server as one
engine (it implements the server's EngineClient, as LLMEngine does).

    engine = DataParallelEngine(EngineConfig(data_parallel_size=2))   # starts and loads both replicas
    engine.add_request("r1", {"prompt": None, "prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        deltas = engine.step()

add_request checks the request here (request_check.py: a refusal is a RequestError at once), asks the
Router which replica takes it (load and prefix affinity) and sends it there; the request ids stay the
caller's. Each replica runs its own loop (replica_process.py) and sends each step's outputs up as soon
as it has them, so step() never runs or waits for a replica's step: it drains what arrived, waiting
STEP_WAIT_SECONDS at most when nothing has. abort_request tells the owning replica and returns the
"abort" finals made here (the replica's own come a step later and would be stale).

A replica whose process ends or goes silent, or whose engine raised EngineDeadError, makes every call
raise EngineDeadError("replica i", why): the server stops. shutdown() stops and joins every replica;
replicas also leave on their own when the server process dies (their command pipe ends).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import queue
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

from pagedserve.engine.data_parallel.merge import merge_snapshots, merge_stats
from pagedserve.engine.data_parallel.messages import (Abort, Add, Dead, LoadFailed, Outputs, Ready, Snapshot,
                                                      SnapshotReply, StepFailed)
from pagedserve.engine.data_parallel.placement import place_replicas
from pagedserve.engine.data_parallel.replica_handle import PipeClosed, ReplicaHandle, describe_exit
from pagedserve.engine.data_parallel.request_check import RequestCheck
from pagedserve.engine.data_parallel.router import Router
from pagedserve.engine.info import EngineInfo
from pagedserve.engine_config import EngineConfig
from pagedserve.errors import EngineDeadError, RequestError
from pagedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve")

# Longest step() waits for a replica's outputs when none has arrived: short next to a step (tens of
# ms on a GPU, more on a CPU), so a request submitted meanwhile joins within it.
STEP_WAIT_SECONDS = 0.005
SNAPSHOT_TIMEOUT_SECONDS = 60.0
STOP_SECONDS = 10.0


@dataclass
class _Tracked:
    """What the server side keeps of a request a replica runs: enough to restore the prompt on its
    outputs and to end it with "abort" finals."""

    replica: int
    prompt: Optional[str]
    prompt_token_ids: list[int]
    n: int
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    finished_samples: set[int] = field(default_factory=set)

    def observe(self, out: RequestOutput) -> None:
        out.prompt, out.prompt_token_ids = self.prompt, self.prompt_token_ids
        self.metrics, self.num_cached_tokens = out.metrics, out.num_cached_tokens
        self.finished_samples.update(c.index for c in out.outputs if c.finish_reason is not None)

    def abort_output(self, request_id: str) -> RequestOutput:
        self.metrics.finished_time = time.monotonic()
        outputs = [CompletionOutput(i, "", [], finish_reason="abort") for i in range(self.n)
                   if i not in self.finished_samples]
        return RequestOutput(request_id, self.prompt, self.prompt_token_ids, outputs, True, self.metrics,
                             num_cached_tokens=self.num_cached_tokens)


class DataParallelEngine:
    def __init__(self, config: EngineConfig):
        if config.data_parallel_size < 2:
            raise ValueError(f"DataParallelEngine needs data_parallel_size >= 2, got {config.data_parallel_size}")
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (replica index, report) from every replica
        self._replicas: list[ReplicaHandle] = []
        self._closed = False
        self._dead = False  # a replica failed: shutdown() kills rather than asks (a hung one cannot answer)
        atexit.register(self._kill_all)  # however the server ends, no replica outlives it
        try:
            for placement in place_replicas(config):
                self._replicas.append(ReplicaHandle(placement, config, self._inbox, context))
            ready = self._wait_ready()
        except BaseException:
            self._kill_all()
            raise
        first = ready[0]
        tokenizer = None
        if first.has_tokenizer:
            from pagedserve.engine.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(first.info.model_path)
        self._info = dataclasses.replace(first.info, tokenizer=tokenizer,
                                         device=f"{first.info.device} x {len(ready)} replicas")
        self._check = RequestCheck(self._info, first.eos_token_ids)
        self._stats = [r.stats for r in ready]
        self._step_sums: dict = {}
        self._router = Router(len(ready), first.block_size, [r.stats["num_blocks"] for r in ready])
        self._requests: dict[str, _Tracked] = {}
        self._held: list = []  # reports taken while waiting for snapshots, handled by the next step()
        self._snapshot_token = 0
        for handle in self._replicas:
            handle.watch_silence()
            logger.info("data parallel: replica %d is pid %d on %s", handle.index, handle.pid,
                        handle.placement.describe())

    def _wait_ready(self) -> list[Ready]:
        ready: dict[int, Ready] = {}
        while len(ready) < len(self._replicas):
            try:
                index, message = self._inbox.get(timeout=1.0)
            except queue.Empty:
                continue
            if isinstance(message, Ready):
                ready[index] = message
            elif isinstance(message, LoadFailed):
                if message.bad_input:
                    raise ValueError(message.message)
                raise RuntimeError(f"replica {index} failed to load the model: {message.message}")
            elif isinstance(message, PipeClosed):
                code = self._replicas[index].wait_exit(5)
                why = describe_exit(code) if code is not None else "its pipe closed"
                raise RuntimeError(f"replica {index} died while loading the model: {why}")
        return [ready[i] for i in range(len(self._replicas))]

    # ------------------------------------------------------------------ EngineClient
    def info(self) -> EngineInfo:
        return self._info

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams,
                    arrival_time: Optional[float] = None) -> None:
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id", "duplicate_id")
        text, ids = self._check.prompt(prompt, params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        replica = self._router.route(request_id, ids, params.n)
        self._requests[request_id] = _Tracked(replica, text, ids, params.n, RequestMetrics(arrival_time=arrival))
        self._replicas[replica].send(Add(request_id, text, ids, params, arrival))

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        finals, by_replica = [], defaultdict(list)
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            tracked = self._requests.pop(rid, None)
            if tracked is None:
                continue
            self._router.finished(rid)
            by_replica[tracked.replica].append(rid)
            finals.append(tracked.abort_output(rid))
        for index, ids in by_replica.items():
            self._replicas[index].send(Abort(ids))
        return finals

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        self._step_sums = {}
        reports, self._held = self._held, []
        reports += self._drain(STEP_WAIT_SECONDS if not reports else 0.0)
        outputs, failures = self._handle(reports)
        self._raise_if_failed()
        if failures:  # as one engine's failed step: the server fails what is in flight and serves on
            raise RuntimeError("; ".join(failures))
        return outputs

    def stats(self) -> dict:
        return merge_stats(self._stats, self._step_sums)

    def snapshot(self) -> dict:
        self._snapshot_token += 1
        token = self._snapshot_token
        for handle in self._replicas:
            handle.send(Snapshot(token))
        replies: dict[int, dict] = {}
        deadline = time.monotonic() + SNAPSHOT_TIMEOUT_SECONDS
        while len(replies) < len(self._replicas):
            for index, message in self._drain(0.05):
                if isinstance(message, SnapshotReply):
                    if message.token == token:
                        replies[index] = message.snapshot
                else:
                    self._held.append((index, message))
            self._raise_if_failed(self._held)
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(self._replicas))) - set(replies))
                raise RuntimeError(f"replica(s) {missing} did not answer a snapshot within "
                                   f"{SNAPSHOT_TIMEOUT_SECONDS:g} s")
        snapshots = [replies[i] for i in range(len(self._replicas))]
        about = [{"pid": h.pid, "device": h.placement.describe()} for h in self._replicas]
        return merge_snapshots(snapshots, merge_stats([s["stats"] for s in snapshots], self._step_sums), about)

    def check_health(self) -> None:
        reports, self._held = self._held + self._drain(0.0), []
        self._handle(reports)  # idle: nothing of ours runs, so they only bring the replicas' latest stats
        self._raise_if_failed()

    def shutdown(self) -> None:
        """Stops every replica (each aborts what it runs and frees its device) and joins them."""
        if self._closed:
            return
        self._closed = True
        if self._dead:
            self._kill_all()
            return
        for handle in self._replicas:
            handle.request_stop()
        deadline = time.monotonic() + STOP_SECONDS
        for handle in self._replicas:
            handle.wait_exit(max(0.0, deadline - time.monotonic()))
        self._kill_all()

    # ------------------------------------------------------------------ reports
    def _drain(self, wait: float) -> list:
        reports = []
        try:
            reports.append(self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait())
            while True:
                reports.append(self._inbox.get_nowait())
        except queue.Empty:
            return reports

    def _handle(self, reports: list) -> tuple[list[RequestOutput], list[str]]:
        """The outputs in `reports` (the stats they carry taken in) and the replicas' step failures
        among them; a dead replica's report is held for _raise_if_failed."""
        outputs, failures = [], []
        for index, message in reports:
            if isinstance(message, Outputs):
                self._take_outputs(index, message, outputs)
            elif isinstance(message, StepFailed):
                failures.append(f"replica {index}: {message.message}")
            elif isinstance(message, (Dead, PipeClosed)):
                self._held.append((index, message))  # _raise_if_failed reports it
        return outputs, failures

    def _take_outputs(self, index: int, message: Outputs, outputs: list) -> None:
        self._stats[index] = message.stats
        if message.stepped:
            self._step_sums.setdefault("replica_step_seconds", []).append(message.step_seconds)
            for key in ("step_num_seqs", "step_prefill_tokens", "step_decode_tokens"):
                self._step_sums[key] = self._step_sums.get(key, 0) + message.stats.get(key, 0)
        for out in message.outputs:
            tracked = self._requests.get(out.request_id)
            if tracked is None:
                continue  # aborted here while the replica was still producing it
            tracked.observe(out)
            self._router.started(out.request_id)
            if out.finished:
                del self._requests[out.request_id]
                self._router.finished(out.request_id)
            outputs.append(out)

    def _raise_if_failed(self, reports: Optional[list] = None) -> None:
        """EngineDeadError for the first replica that died, hung or reported its engine dead."""
        for index, message in (self._held if reports is None else reports):
            if isinstance(message, Dead):
                self._fail(f"replica {index} ({message.who})", message.why)
            if isinstance(message, PipeClosed):
                code = self._replicas[index].wait_exit(1.0)
                self._fail(f"replica {index}", describe_exit(code) if code is not None else
                           "its pipe closed (the process is exiting)")
        for handle in self._replicas:
            why = handle.failure()
            if why is not None:
                self._fail(f"replica {handle.index}", why)

    def _fail(self, who: str, why: str) -> None:
        self._dead = True
        raise EngineDeadError(who, why)

    def _kill_all(self) -> None:
        for handle in self._replicas:
            handle.kill()
        atexit.unregister(self._kill_all)
