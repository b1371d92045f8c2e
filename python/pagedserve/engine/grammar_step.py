"""One step's grammars as the sampler takes them, and when it pays to check draws before masking.

A sampler that draws each row's token independently of the other rows (the Gumbel-max pass,
Sampler._launch_gumbel_max) can draw unmasked first, ask `refused`, and mask and redraw only the refused
rows: a token the grammar accepts is the one the masked draw gives too. That saves the masks of the
accepted rows but adds a check per row (~1.4 us on a Zen 4 core) and, when any row is refused, a second
pass after the first one's tokens reach the host, with masks filled then rather than while the forward
runs. SmolLM2-135M's JSON draws are refused often (5-6 % of rows per step at 64 rows, 8-20 % per token
alone), so checking pays only where masks are dear. On an H200 host, 64 rows, `structured_bench.py`
(bench/results/h200/session15.md): JSON strings with maxLength 24 (10 ms of masks a step) 12 % of
unconstrained with every mask filled, 36-38 % checked; plain JSON (1.1 ms) 58-60 % either way; compact
JSON (0.75 ms) 68-72 % filled, 63 % checked; tool calls (a structural tag over free text, 0.5 ms, no draw
refused) 68-74 % filled, 79-83 % checked. Hence CheckFirstPolicy.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from pagedserve.engine.grammar_backends import accepts
from pagedserve.sample.grammar_mask import GrammarMask

# Check draws first where a step's masks would take more host time than this: above the 1.1 ms that plain
# JSON at 64 rows costs, below bounded strings' 10 ms.
CHECK_FIRST_SECONDS = 2e-3
REFUSING = 0.25  # ... or where fewer checked steps than this share had a row refused (tools: none of them)
EXPLORE_CHECK_EVERY = 16  # while filling: one step in this many checks, to see how often draws are refused
EXPLORE_FILL_EVERY = 64  # while checking: one step in this many fills every mask, to see what masks cost
# What a row's mask costs is the least of the last FILL_WINDOW steps that filled every mask: the grammar
# thread times its fills across hand-overs of the GIL, which only add, and on an H200 host one slow
# hand-over in a few steps made a plain JSON step look dear, so that the next went to the engine's thread,
# every other step of 64 rows (bench/results/h200/session38.md); a median took three cheap fills to forget a
# grammar's slow first ones (its lexer built), 3 x EXPLORE_FILL_EVERY steps once checking: the H200 probe's
# JSON steps all stayed on the engine's thread. Dear masks (strings of bounded length) are dear in every step.
FILL_WINDOW = 5


class CheckFirstPolicy:
    """Decides step by step whether rows check their draws before masking, from two figures measured as
    the engine runs: what one row's mask costs (the last step that filled every mask) and how often a
    checked step had a row refused (a moving average). Checking pays where masks are dear or draws rarely
    refused; now and then a step runs the other way to keep the other figure fresh. A threshold of 0
    always checks."""

    def __init__(self, threshold: float = CHECK_FIRST_SECONDS):
        self.threshold = threshold
        self.row_fill_seconds: Optional[float] = None  # the least of _row_costs
        self._row_costs: deque[float] = deque(maxlen=FILL_WINDOW)
        self.refusing: Optional[float] = None
        self._steps = 0

    def decide(self, rows: int) -> bool:
        if self.threshold <= 0:
            return True
        self._steps += 1
        check = self.prefers_check(rows)
        if self._steps % (EXPLORE_FILL_EVERY if check else EXPLORE_CHECK_EVERY) == 0:
            return not check
        return check

    def dear(self, rows: int) -> bool:
        """Whether `rows` masks would cost more than the threshold, at the last measured cost."""
        return rows * (self.row_fill_seconds or 0.0) >= self.threshold

    def prefers_check(self, rows: int) -> bool:
        return self.dear(rows) or (self.refusing is not None and self.refusing < REFUSING)

    def note_fill(self, rows: int, seconds: float) -> None:
        """A step filled all its `rows` masks in `seconds`."""
        if rows:
            self._row_costs.append(seconds / rows)
            self.row_fill_seconds = min(self._row_costs)

    def note_check(self, any_refused: bool) -> None:
        """A checked step had a row refused, or none."""
        x = 1.0 if any_refused else 0.0
        self.refusing = x if self.refusing is None else 0.75 * self.refusing + 0.25 * x


@dataclass
class GrammarStats:
    """Host time and rows of the structured-output masks, summed over the engine's life (the benchmarks
    read them)."""

    mask_seconds: float = 0.0  # filling masks (with the grammar thread: settling its jobs and placing their masks)
    thread_seconds: float = 0.0  # the grammar thread's accepts and masks (engine/grammar_thread.py)
    steps_waited_on_device: int = 0  # steps whose draw read the thread's masks as they were, waiting on its device
    check_seconds: float = 0.0  # checking drawn tokens (GrammarStep.refused)
    rows_filled: int = 0  # masks filled
    rows_checked: int = 0  # drawn tokens checked
    rows_refused: int = 0  # ... and refused


class GrammarStep:
    """A step's (logits row, matcher) pairs: the token mask of every constrained row or of some rows only
    (`mask`), which rows' drawn tokens the grammars refuse (`refused`), and whether checking draws first
    is expected to pay (`check_first`). The sampler's sample.grammar_mask.MaskSource.

    With `thread` (the grammar thread takes the step: engine/grammar_thread.py, `threaded`), a plain draw
    takes `threaded_mask()`, whose rows may still be filling on the thread (the draw waits for them on its
    device), and once queued is handed to `drawn(pending)` so the thread takes its tokens as they reach the
    host; any other draw takes `mask()`, the thread's jobs settled first. Such a step fills every mask, so
    where masks are dear (CheckFirstPolicy.dear, fed the thread's fill times too) the step is not the
    thread's: checking draws first pays there."""

    def __init__(self, fill: Callable[[list], Optional[GrammarMask]], matchers: list[tuple[int, object]],
                 stats: GrammarStats, policy: CheckFirstPolicy, check_first: bool,
                 thread: Optional[tuple[Callable, Callable]] = None):
        """check_first: the policy's decision for this step (policy.decide); `thread`, only where it is False:
        the grammar thread's (fill_threaded, drawn) (engine/grammar.py Grammars)."""
        self._fill = fill
        self._matchers = matchers
        self._stats = stats
        self._policy = policy
        self._thread = thread
        self.threaded = thread is not None
        self.check_first = check_first

    def threaded_mask(self) -> Optional[GrammarMask]:
        """The mask of a plain draw that is handed to drawn() next (a threaded step's)."""
        return self._thread[0](self._matchers)

    def drawn(self, pending) -> None:
        """The step's plain draw is queued (`pending`, its PendingSamples); a threaded step's, after
        threaded_mask()."""
        self._thread[1](self._matchers, pending)

    def mask(self, rows: Optional[Sequence[int]] = None) -> Optional[GrammarMask]:
        """The mask of the constrained rows (of those among `rows`, if given); None when none needs one."""
        if rows is None:
            start = time.perf_counter()
            mask = self._fill(self._matchers)
            if not self.threaded:  # placing the thread's masks is not what a mask costs
                self._policy.note_fill(len(self._matchers), time.perf_counter() - start)
            return mask
        wanted = set(rows)
        return self._fill([(row, m) for row, m in self._matchers if row in wanted])

    def refused(self, token_ids: Sequence[int]) -> list[int]:
        """The rows whose drawn token (token_ids[row]) their grammar refuses; a terminated grammar takes
        any token (its row is not masked either). No matcher moves."""
        start = time.perf_counter()
        out = [row for row, m in self._matchers if not m.is_terminated() and not accepts(m, token_ids[row])]
        stats = self._stats
        stats.check_seconds += time.perf_counter() - start
        stats.rows_checked += len(self._matchers)
        stats.rows_refused += len(out)
        self._policy.note_check(bool(out))
        return out
