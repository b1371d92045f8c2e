"""The grammar thread: llguidance's token masks filled beside the engine's thread, so grammar steps run ahead.

A JSON step of 64 rows on an H200 host costs ~0.6 ms of llguidance masks and ~0.1 ms of accepts on top
of the engine's ~1 ms of Python, against ~1.2 ms of device work a step: filled on the engine's thread
they made the step host-bound (60 % of unconstrained, bench/results/h200/session36.md). Here a thread
of their own takes a step's tokens the moment they reach the host (it waits on the draw's event, not
on the engine), has each matcher consume its token, and fills the next masks, while the engine's thread
commits, records, emits and schedules; the draw that needs the masks is queued just before the next
forward (sample/pending.py, PendingSamples.deferred), and such steps run ahead. On an H200 host (64
rows, SmolLM2, bench/results/h200/session37.md) JSON went from 53-60 % of unconstrained to 71-84 %,
compact JSON from 59-73 % to 78-85 %. Where masks are dear (strings of bounded length: ~13 ms a step
here) the thread cannot keep up; those steps stay on the engine's thread, which checks draws first
(engine/grammar.py Grammars.step).

Both llguidance calls (consume_token_par, unsafe_compute_mask_ptr) drop the GIL; between them the
thread needs it back. Python hands it over only every sys.getswitchinterval() (5 ms by default) to a
thread that asks while another runs Python, so while a job runs the interval is SWITCH_INTERVAL (other
threads, xgrammar's pool among them, keep the process's own otherwise). On a 2-core Zen 5 VM, 64 rows
of SmolLM2's JSON while the other thread ran Python: 0.39 ms a step on the engine's thread; on this
thread 1.33 ms at 5 ms, 0.72 ms at 50 us, 0.62 ms at 20 us, the engine's own loop slowed by ~1 %. The
GIL still costs: on the H200 host a job takes 0.8-1.1 ms where the masks on the engine's thread took
0.5-0.9, and a JSON step kept the engine's thread 2.0 ms against 1.2 unconstrained (its probe,
bench/perf/probes/step_phases.py): the masks' wait, the deferred draw's launch and the record's share.

Jobs are one step at a time: `submit(pairs, pending)` when step k's draw is queued; the job has each
(row, matcher) pair consume the token of its row and fills the live matchers' masks into rows of a
buffer of its own (the same row numbers). `settle()` waits for the job and hands the matchers back;
`place_masks(job, pairs, out)` finds step k + 1's masks, in the job's buffer where its rows line up.
Only Grammars (engine/grammar.py) drives this class, on the engine's thread.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence

import torch

SWITCH_INTERVAL = 2e-5  # seconds: the GIL's hand-over interval while a job runs (see above)
_RING = 4  # mask buffers in turn; a step takes at most two, and a buffer's last copy to the device is done
#            once the engine has the next step's tokens, two steps later at the latest


class _Job:
    """One step's tokens to consume and masks to fill. Made on the engine's thread, which also lists the
    matchers' llguidance objects and rows, so the grammar thread holds the GIL as briefly as it can."""

    def __init__(self, pairs: list[tuple[int, object]], pending, buffer: torch.Tensor, interval: float):
        self.pairs = pairs  # (row, LLGuidanceMatcher)
        self.raws = [m.raw for _, m in pairs]
        self.rows = [row for row, _ in pairs]
        self.pending = pending  # the step's PendingSamples: host_ids() once queued
        self.buffer = buffer
        self.interval = interval  # the process's GIL switch interval, restored when the job ends
        self.live: dict[int, int] = {}  # id(matcher) -> its buffer row, for the matchers still live
        self.ended: list[object] = []  # matchers that refused their token or terminated
        self.seconds = 0.0  # consuming and filling, not waiting for the draw
        self.fill_seconds = 0.0  # filling alone
        self.future: Optional[Future] = None  # the pool's, once submitted


class GrammarThread:
    """The thread is concurrent.futures' one worker: at interpreter exit the pool stops and joins it
    before finalization. (A daemon thread that had waited on a CUDA event was killed in finalization
    instead: "terminate called without an active exception" on an H200 host, after the results.)"""

    def __init__(self, max_rows: int, words: int, pin_memory: bool):
        self._buffers = [torch.full((max_rows, words), -1, dtype=torch.int32, pin_memory=pin_memory)
                         for _ in range(_RING)]
        self._next_buffer = 0
        self._pool: Optional[ThreadPoolExecutor] = None
        self._executor = None  # llguidance's
        self._job: Optional[_Job] = None  # submitted, not settled

    def buffer(self) -> torch.Tensor:
        """The next mask buffer of the ring (see _RING)."""
        buffer = self._buffers[self._next_buffer]
        self._next_buffer = (self._next_buffer + 1) % _RING
        return buffer

    def submit(self, pairs: list[tuple[int, object]], pending) -> None:
        """Step's (row, matcher) pairs take their row's token from `pending` (a queued plain draw) and fill
        their next masks; the engine's thread must not touch these matchers until settle()."""
        self.settle()
        if self._pool is None:
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=1)  # more were slower: MaskFiller
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-grammar")
        interval = sys.getswitchinterval()
        self._job = _Job(pairs, pending, self.buffer(), interval)
        sys.setswitchinterval(min(interval, SWITCH_INTERVAL))  # while the job runs: see the module's docstring
        self._job.future = self._pool.submit(_run, self._job, self._executor)

    def settle(self) -> Optional[_Job]:
        """Waits for the submitted job, if any, and returns it (its matchers are the caller's again)."""
        job, self._job = self._job, None
        if job is None:
            return None
        try:
            job.future.result()
        except Exception as err:
            raise RuntimeError(f"the grammar thread failed: {err}") from err
        return job

    def close(self) -> None:
        self.settle()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _run(job: _Job, executor) -> None:
    """One job on the grammar thread; the process's GIL switch interval is back once it ends."""
    try:
        _consume_and_fill(job, executor)
    finally:
        sys.setswitchinterval(job.interval)


def _consume_and_fill(job: _Job, executor) -> None:
    ids = job.pending.host_ids().tolist()  # waits for the draw (the GIL dropped)
    start = time.perf_counter()
    raws, rows = job.raws, job.rows
    ok = executor.consume_token_par(list(zip(raws, ids if rows[-1] == len(rows) - 1 else [ids[r] for r in rows])))
    live = []
    for (row, m), raw, accepted in zip(job.pairs, raws, ok):
        if accepted and not raw.is_stopped():
            live.append((raw, row))
            job.live[id(m)] = row
        else:
            job.ended.append(m)
    if live:
        fill_start = time.perf_counter()
        buffer = job.buffer
        executor.unsafe_compute_mask_ptr(live, buffer.data_ptr(), buffer.shape[1] * 4, buffer.shape[0])
        job.fill_seconds = time.perf_counter() - fill_start
    job.seconds = time.perf_counter() - start


def place_masks(job: Optional[_Job], pairs: Sequence[tuple[int, object]], out: torch.Tensor
                ) -> tuple[torch.Tensor, list[int], list[tuple[int, object]]]:
    """Where step k + 1's (row, matcher) pairs find their masks: the job's buffer itself when every pair
    sits on its job row (a steady decode batch), else `out` with the job's rows copied in. Returns the
    buffer, the rows placed, and the pairs the job did not fill (new to sampling, or ended) for the caller."""
    if job is None:
        return out, [], list(pairs)
    rows = job.live
    if all(rows.get(id(m)) == row for row, m in pairs):
        return job.buffer, [row for row, _ in pairs], []
    src, dst, missing = [], [], []
    for row, m in pairs:
        at = rows.get(id(m))
        if at is None:
            missing.append((row, m))
        else:
            src.append(at)
            dst.append(row)
    if src:
        out.numpy()[dst] = job.buffer.numpy()[src]
    return out, dst, missing
