"""A step's grammar masks, filled in batches: each backend's rows in one call, on the engine's thread
(fill) or on a thread of their own (start) while the engine's thread goes on."""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Optional, Sequence

import torch

from pagedserve.engine.grammar_backends import LLGuidanceMatcher


class MaskFiller:
    """Fills a step's masks, each backend's rows in one call (pools made on first use): xgrammar's on
    `xgrammar_threads` threads of its BatchGrammarMatcher, which holds the GIL throughout; llguidance's on
    one thread of its LLExecutor, which drops it. More threads made llguidance slower: 64 rows of SmolLM2's
    JSON took 0.70 / 0.88 / 0.94 / 1.08 ms a step on 1 / 2 / 4 / 8 threads of an H200 host (xgrammar's:
    3.97 / 2.35 / 1.30 / 0.96), and a pool shares the cores with torch's threads, which the one thread
    did not feel (bench/results/h200/session34.md). Rows of both backends share the bitmask.

    `start` fills on the filler's own thread and returns at once, so the caller's Python (the step's
    outputs, the next schedule) runs while llguidance's rows fill."""

    def __init__(self, xgrammar_threads: int):
        self._xgrammar_threads = xgrammar_threads
        self._xgrammar = None
        self._llguidance = None
        self._jobs: Optional[queue.SimpleQueue] = None  # the filler thread's, once started

    def fill(self, pairs: Sequence[tuple[int, object]], bitmask: torch.Tensor) -> None:
        """Writes the mask of each (row, matcher) pair into its row of `bitmask` (contiguous int32, on the
        host); terminated matchers are the caller's to leave out."""
        self._work(pairs, bitmask)()

    def start(self, pairs: Sequence[tuple[int, object]], bitmask: torch.Tensor) -> "FillJob":
        """fill() on the filler's thread; returns once that thread has the work. Until the job's wait()
        returns, the matchers and the bitmask are the thread's."""
        job = FillJob(self._work(pairs, bitmask))
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_run_jobs, args=(self._jobs,), name="pagedserve-grammar-masks", daemon=True).start()
        self._jobs.put(job)
        job.started.wait()  # hands the thread the GIL until its fill call drops it
        return job

    def _work(self, pairs, bitmask: torch.Tensor) -> Callable[[], None]:
        """The fill of these pairs as one call, its Python done here (the thread that runs it holds the
        GIL only to enter the backends' calls)."""
        xgr_rows, xgr_matchers, llg = [], [], []
        for row, matcher in pairs:
            if isinstance(matcher, LLGuidanceMatcher):
                llg.append((matcher.raw, row))
            else:
                xgr_rows.append(row)
                xgr_matchers.append(matcher)
        if llg:
            if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
                raise ValueError("the bitmask must be a contiguous int32 CPU tensor")
            if self._llguidance is None:
                import llguidance

                self._llguidance = llguidance.LLExecutor(num_threads=1)
        if xgr_matchers and self._xgrammar is None:
            import xgrammar as xgr

            self._xgrammar = xgr.BatchGrammarMatcher(max_threads=self._xgrammar_threads)
        llguidance_fill, xgrammar_fill = self._llguidance, self._xgrammar
        address, row_bytes, rows = bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]

        def work() -> None:
            if llg:
                llguidance_fill.unsafe_compute_mask_ptr(llg, address, row_bytes, rows)
            if xgr_matchers:
                xgrammar_fill.batch_fill_next_token_bitmask(xgr_matchers, bitmask, xgr_rows)
        return work


class FillJob:
    """A fill running on MaskFiller's thread: wait() returns when it is done (raising what it raised);
    `seconds` is then how long the fill itself took."""

    def __init__(self, work: Callable[[], None]):
        self._work = work
        self.started = threading.Event()
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self.seconds = 0.0

    def run(self) -> None:
        self.started.set()
        start = time.perf_counter()
        try:
            self._work()
        except BaseException as err:  # re-raised by wait(), on the engine's thread
            self._error = err
        self.seconds = time.perf_counter() - start
        self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


def _run_jobs(jobs: queue.SimpleQueue) -> None:
    while True:
        jobs.get().run()
