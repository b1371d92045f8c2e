"""Prompt logprobs on the engine's side: which positions of a step need them, and their results
recorded on the requests (Request.prompt_logprobs, handed back with the first output, as vLLM does).

Request.prompt_logprobs[i] (i >= 1) is the logprob of prompt token i given tokens [0, i): it comes from
the hidden state at position i - 1. Entry 0 is None. A request's positions arrive in order over its
prefill chunks; positions already computed (before a preemption) are not computed again.

Positions the prefix cache supplied are never run by the scheduler's step. The C++ scheduler cannot
skip the prefix cache per request (its binding has no such option), so those positions are recomputed
instead: a forward over them that reads their KV from the sequence's blocks and writes none (the model
runner's _recompute_hidden). The cache stays in use, and the results equal an uncached prefill.
"""

from __future__ import annotations

from typing import Callable, Optional

from pagedserve.engine.request import Request
from pagedserve.outputs import Logprob
from pagedserve.sample.prompt_logprobs import PromptLogprobsPlan, Recompute
from pagedserve.sample.sampler import SampleLogprobs


class PromptLogprobs:
    def __init__(self, entry: Callable[[SampleLogprobs], dict[int, Logprob]]):
        """entry: a row's results as the {token_id: Logprob} dict of one position."""
        self._entry = entry
        self._wanted: dict[int, Request] = {}  # seq id -> request whose prompt logprobs are not all in
        self._plan: Optional[PromptLogprobsPlan] = None
        # Per request of the planned step: (request, first recomputed row, count, first step row, count).
        self._spans: list[tuple[Request, int, int, int, int]] = []

    def add(self, seq_id: int, request: Request) -> None:
        if request.params.prompt_logprobs is None:
            return
        request.prompt_logprobs = [None]
        if len(request.prompt_token_ids) > 1:
            self._wanted[seq_id] = request

    @property
    def idle(self) -> bool:
        """No planned step's prompt logprobs wait to be recorded. The engine runs a step ahead only then: the
        next plan counts each request's positions recorded so far, and one plan is held at a time."""
        return self._plan is None

    def plan(self, out) -> Optional[PromptLogprobsPlan]:
        """The prompt logprobs step `out` (a _core.StepOutput) computes, or None."""
        self._plan, self._spans = None, []
        for seq_id in [s for s, r in self._wanted.items() if r.finished or _complete(r)]:
            del self._wanted[seq_id]
        if not self._wanted:
            return None
        plan, step_targets, num_recomputed = PromptLogprobsPlan(top_n=0), [], 0
        qsl, positions = out.query_start_loc, out.positions
        for row, seq_id in enumerate(out.seq_ids.tolist()):
            request = self._wanted.get(seq_id)
            if request is None:
                continue
            prompt = request.prompt_token_ids
            done, end = len(request.prompt_logprobs) - 1, len(prompt) - 1  # positions [done, end) are wanted
            first, start = int(positions[qsl[row]]), int(qsl[row])
            num_recompute = max(0, min(first, end) - done)
            if num_recompute:  # a prefix-cache hit: positions [done, first) are not in this step
                plan.recompute.append(Recompute(prompt[done:done + num_recompute], done, out.block_tables[row].copy(),
                                                len(prompt)))
                plan.targets.extend(prompt[done + 1:done + 1 + num_recompute])
            step_positions = range(max(first, done), min(first + int(qsl[row + 1]) - start, end))
            self._spans.append((request, num_recomputed, num_recompute, len(plan.step_rows), len(step_positions)))
            num_recomputed += num_recompute
            plan.step_rows.extend(start + p - first for p in step_positions)
            step_targets.extend(prompt[p + 1] for p in step_positions)
            plan.top_n = max(plan.top_n, request.params.prompt_logprobs)
        plan.targets.extend(step_targets)
        if not plan.targets:
            return None
        self._plan = plan
        return plan

    def record(self, pending) -> None:
        """The planned step's results (pending: the model runner's PendingSamples) onto their requests."""
        if self._plan is None or pending is None or pending.prompt_logprobs is None:
            return
        results = pending.prompt_logprobs.result()
        num_recomputed = sum(len(r.token_ids) for r in self._plan.recompute)
        for request, rec, num_rec, step, num_step in self._spans:
            top_n = request.params.prompt_logprobs
            rows = results[rec:rec + num_rec] + results[num_recomputed + step:num_recomputed + step + num_step]
            for lp in rows:
                lp.top = lp.top[:top_n]
                request.prompt_logprobs.append(self._entry(lp))
        self._plan, self._spans = None, []


def _complete(request: Request) -> bool:
    return len(request.prompt_logprobs) >= len(request.prompt_token_ids)
