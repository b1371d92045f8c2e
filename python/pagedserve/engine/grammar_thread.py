"""The grammar thread: llguidance's token masks filled beside the engine's thread, which does not wait for them.

A JSON step of 64 rows on an H200 host costs ~0.6 ms of llguidance masks and ~0.1 ms of accepts on top
of the engine's ~1 ms of Python, against ~1.2 ms of device work a step: filled on the engine's thread
they made the step host-bound (60 % of unconstrained, bench/results/h200/session36.md). Here a thread
of their own takes a step's tokens the moment they reach the host (it waits on the draw's event, not
on the engine), has each matcher consume its token, fills the next masks into pinned memory, and raises a
counter there (`flag`). The engine's thread queues the next step's draw right after its forward, as for
unconstrained rows, with a wait on the device for that counter before the masks' copy (ops.wait_for_flag),
so it never waits for the masks itself while a batch's rows stay where they were: it commits, records, emits
and schedules, and such steps run ahead. (Session 37's version queued the draw only once the masks were in,
just before the next forward: the engine's thread waited ~0.2 ms a step for them and queued the draw then,
~0.3 ms more. JSON on an H200 host, 64 rows: 64-75 % of unconstrained that way, 83-85 % this way in the same
call, bench/results/h200/session38.md, where the job, 0.94 ms on one thread, was then what the device waited
for; on the GrammarPool's four threads it takes 0.3-0.5 ms and JSON ran at 93-97 %, session39.md.) Where masks
are dear (strings of bounded length: ~13 ms a step there) the thread cannot keep up; those steps stay on the
engine's thread, which checks draws first (engine/grammar.py Grammars.step).

The thread is C++ (cpp/grammar/grammar_worker.h, over the GrammarPool: llguidance's C API on up to four
threads): it waits for the draw's event, consumes, fills and raises the flag without running Python, so it
never waits for the GIL nor makes the engine's thread hand it over. (Session 39's Python thread needed it
three times a job: each hand-over waited up to a switch interval, which it shortened to 20 us while jobs were
queued, and woke two threads; JSON at 64 rows on an H200 host ran at 92-97 % of unconstrained.)

Jobs run in the order submitted, one at a time: `submit(pairs, pending)` when step k's draw is queued; the
job has each (row, matcher) pair consume the token of its row, fills the matchers' masks into rows of a
buffer of its own (the same row numbers; an ended matcher's row holds a mask of EOS alone), then raises the
flag to its number. Step k + 1's plain draw, which the thread takes next, reads that buffer as it is when
its (row, matcher) pairs are the job's (`lines_up`), after `ready` waits (on the device) for the job;
otherwise (other pairs, or a draw the thread does not take: logprobs, top-p) the engine's thread settles
every job and `place_masks` copies the rows it can. `settle(keep_newest)` waits for jobs and hands them back (their
matchers are the caller's again). Only Grammars (engine/grammar.py) drives this class, on the engine's thread.
"""

from __future__ import annotations

import atexit
import weakref
from collections import deque
from typing import Callable, Optional, Sequence

import torch

from pagedserve import ops
from pagedserve._core.grammar import GrammarPool, GrammarWorker, MatcherRows

_RING = 4  # mask buffers in turn; a step takes at most two, and a buffer's last copy to the device is done
#            once the engine has the next step's tokens, two steps later at the latest
WAIT_SECONDS = 60.0  # a draw waiting longer than this for its masks goes on without them, and the engine raises


class _Job:
    """One step's tokens to consume and masks to fill, made on the engine's thread; in a steady batch the
    pairs are the last job's, whose lists it shares (`like`: none is changed once made)."""

    def __init__(self, number: int, pairs: list[tuple[int, object]], pending, buffer: torch.Tensor,
                 like: Optional[_Job] = None):
        self.number = number  # the flag's value once the job is done: 1, 2, ... in order
        self.pairs = pairs  # (row, LLGuidanceMatcher)
        if like is None:
            self.raws = [m.raw for _, m in pairs]  # the LlgMatchers, alive while the worker holds their addresses
            self.rows = [row for row, _ in pairs]
            self.row_of = {id(m): row for row, m in pairs}
            self.matcher_rows = MatcherRows(self.raws, self.rows)
        else:
            self.raws, self.rows, self.row_of, self.matcher_rows = like.raws, like.rows, like.row_of, like.matcher_rows
        self.pending = pending  # the step's PendingSamples: its ids stay alive until the job is settled
        self.buffer = buffer
        self.live: dict[int, int] = {}  # id(matcher) -> its buffer row, for the matchers still live
        self.ended: list[object] = []  # matchers that refused their token or terminated
        self.outcomes: list[int] = []  # per pair: its GrammarPool outcome (REFUSED, LIVE, STOPPED)
        self.seconds = 0.0  # consuming and filling (one pass of the pool), not waiting for the draw


class GrammarThread:
    """The engine's side of the grammar worker. A process that exits with jobs in flight closes it first
    (atexit): the worker may be waiting on a CUDA event when the runtime goes."""

    def __init__(self, max_rows: int, words: int, pin_memory: bool, pool):
        """pool: the GrammarPool (pagedserve._core.grammar) that runs a job's accepts and masks."""
        self._buffers = [torch.full((max_rows, words), -1, dtype=torch.int32, pin_memory=pin_memory)
                         for _ in range(_RING)]
        self._next_buffer = 0
        # [number of the last job done, 1 once a device's wait timed out]: raised by the worker, read by the
        # device (pinned) or the host
        self.flag = torch.zeros(2, dtype=torch.int64, pin_memory=pin_memory)
        self._flag = self.flag.numpy()
        self._worker = GrammarWorker(pool)  # its thread starts with the first job
        self._jobs: deque[_Job] = deque()  # submitted, not settled, oldest first
        self._submitted = 0
        atexit.register(_close_at_exit, weakref.ref(self))

    def buffer(self) -> torch.Tensor:
        """The next mask buffer of the ring (see _RING)."""
        buffer = self._buffers[self._next_buffer]
        self._next_buffer = (self._next_buffer + 1) % _RING
        return buffer

    @property
    def newest(self) -> Optional[_Job]:
        """The last job submitted, if it is not settled."""
        return self._jobs[-1] if self._jobs else None

    def submit(self, pairs: list[tuple[int, object]], pending) -> _Job:
        """Step's (row, matcher) pairs take their row's token from `pending` (a queued plain draw) and fill
        their next masks, after the jobs before; the engine's thread must not touch these matchers until
        settle() returns this job (returned)."""
        newest = self.newest
        like = newest if newest is not None and newest.pairs == pairs else None
        self._submitted += 1
        job = _Job(self._submitted, list(pairs), pending, self.buffer(), like)
        ids, num_ids, ready, device = pending.host_view()
        buffer = job.buffer
        self._worker.submit(job.number, job.matcher_rows, ids, num_ids, ready, device, buffer.data_ptr(),
                            buffer.shape[0], buffer.shape[1], self.flag.data_ptr())
        self._jobs.append(job)
        return job

    def ready(self, job: _Job) -> Callable[[torch.device], None]:
        """What makes a device wait for `job`'s masks before it reads them (GrammarMask's `ready`)."""
        return lambda device: ops.wait_for_flag(self.flag, job.number, device, WAIT_SECONDS)

    def settle(self, keep_newest: bool = False) -> list[_Job]:
        """Waits for the submitted jobs (all, or all but the newest) and returns them, oldest first: their
        matchers are the caller's again. RuntimeError where a job failed or a device gave up waiting."""
        done = []
        while len(self._jobs) > (1 if keep_newest else 0):
            job = self._jobs.popleft()
            done.append(job)
            try:
                job.outcomes, job.seconds = self._worker.wait(job.number)
            except Exception as err:
                raise RuntimeError(f"the grammar thread failed: {err}") from err
            _sort_ended(job)
        if self._flag[1]:
            raise RuntimeError(f"a draw waited more than {WAIT_SECONDS:g} s for the grammar thread's masks")
        return done

    def close(self) -> None:
        try:
            self.settle()
        finally:
            self._worker.close()

    def __del__(self) -> None:
        # The worker's queued jobs write into the flag and buffers, which go with this object: they run first.
        worker = getattr(self, "_worker", None)
        if worker is not None:
            worker.close()


def _close_at_exit(ref: weakref.ref) -> None:
    thread = ref()
    if thread is not None:
        thread._worker.close()


def _sort_ended(job: _Job) -> None:
    """The job's live matchers (by buffer row) and those that refused their token or terminated, from the
    outcomes the pool found (no call to a matcher)."""
    ended = [i for i, outcome in enumerate(job.outcomes) if outcome != GrammarPool.LIVE]
    job.ended = [job.pairs[i][1] for i in ended]
    if not ended:
        job.live = job.row_of  # shared (read only)
        return
    gone = {id(m) for m in job.ended}
    job.live = {key: row for key, row in job.row_of.items() if key not in gone}


def lines_up(job: Optional[_Job], pairs: Sequence[tuple[int, object]]) -> bool:
    """Whether `pairs` are the job's own (row, matcher) pairs, the same matchers on the same rows: then the
    next step reads the job's buffer as it is, every other row of it free for masks of no grammar."""
    if job is None or len(pairs) != len(job.pairs):
        return False
    if pairs == job.pairs:  # the same pairs in the same order: a steady batch, compared in C
        return True
    row_of = job.row_of
    return all(row_of.get(id(m)) == row for row, m in pairs)


def place_masks(job: Optional[_Job], pairs: Sequence[tuple[int, object]], out: torch.Tensor
                ) -> tuple[torch.Tensor, list[int], list[tuple[int, object]]]:
    """Where step k + 1's (row, matcher) pairs find the masks of a settled job: its buffer itself when every
    pair sits on its live job row, else `out` with the job's rows copied in. Returns the
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
