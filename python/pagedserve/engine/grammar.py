"""Structured outputs: compiling a request's grammar and the per-step token bitmask.

`Grammars` (one per engine, its backends built on first use) turns a StructuredOutputsParams into a
compiled grammar, cached by the spec, when the request is added: a spec that does not compile is a
RequestError before the request is queued. Two backends compile (pagedserve.engine.grammar_backends
has both, behind one matcher interface): by default llguidance takes json schemas and xgrammar the
other kinds, each falling back to the other for the kinds both take (backend_order; the engine's
structured_outputs_backend may name one), and only when every backend tried refuses is the spec an
error, naming each one's problem. Which backend compiled is logged and kept on the compiled grammar
(`compile(spec).backend`).

Each sample of such a request keeps its own matcher, advanced with every token the engine records
(TokenRecorder._add_token). Forks (n > 1) fork at the first sampled token: the row that forks is sampled
under the shared initial state and each sample's matcher, created with the request, accepts its own
token. Preemption by recompute keeps a sequence's tokens, so its matcher needs nothing.

Each step, `step` hands the sampler the rows that have a matcher (engine/grammar_step.py). Their
next-token masks are written into a host int32 bitmask ([max rows, ceil(vocab / 32)], one layout for both
backends) and applied to the logits (on their device) before any sampling parameter: for every row, or,
where the sampler draws each row alone and checking pays (masks dear, or draws rarely refused), only for
the rows whose unmasked draw the grammar refuses. The stop tokens are allowed only where the grammar accepts, so EOS ends a sequence only on
a complete output. With the engine's structured_outputs_thread on (CUDA's default), a step whose rows are
all llguidance's and whose masks are not dear goes to the grammar thread (engine/grammar_thread.py): it
takes the step's tokens as they reach the host and fills the next masks while the engine goes on.
"""

from __future__ import annotations

import logging
import os
import re
import time
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Sequence

import torch

from pagedserve._core.grammar import GrammarPool
from pagedserve.engine.grammar_backends import (CompiledGrammar, LLGuidanceBackend, LLGuidanceMatcher, MaskFiller,
                                                XgrammarBackend, grammar_pool_threads)
from pagedserve.engine.grammar_step import CHECK_FIRST_SECONDS, CheckFirstPolicy, GrammarStats, GrammarStep
from pagedserve.engine.grammar_thread import GrammarThread, lines_up, place_masks
from pagedserve.engine_config import STRUCTURED_OUTPUTS_BACKENDS
from pagedserve.errors import RequestError
from pagedserve.sample.grammar_mask import GrammarMask
from pagedserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger("pagedserve")

_CACHE_SIZE = 256

# Threads filling a step's xgrammar masks: 64 masks took 1.08-1.77 / 0.86-1.14 / 0.51-0.65 / 0.46-0.54 /
# 0.62-0.69 ms on 1 / 2 / 4 / 8 / 16 threads of an H200 host's 16 cores (every row mid-string, four runs of
# structured_bench.py, session 31): past 8, the pool's overhead outgrows the work. llguidance's take a
# GrammarPool (grammar_pool_threads).
_FILL_THREADS = 8



def backend_order(backend: str, kind: str) -> tuple[str, ...]:
    """The backends that try a spec of `kind`, in turn, under the engine's structured_outputs_backend.
    "xgrammar" is xgrammar alone; "llguidance" is llguidance for the kinds it takes and xgrammar for the
    rest (choice, json_object, structural tags in the "format" form), which llguidance has no form of.
    "auto" gives json schemas to llguidance first: replaying SmolLM2's own JSON, its masks cost a quarter of
    xgrammar's on one core (5.4 vs 22 us a row on a Zen 4 core; 0.70 vs 3.97 ms a step of 64 rows on an H200
    host, where xgrammar's 8 threads take 0.96; 0.29 on 4 threads of llguidance's GrammarPool), and its JSON strings
    take no special tokens (xgrammar's take <|im_start|> and the like as text). In the engine on that H200
    host JSON went from 44-51 % of unconstrained (xgrammar) to 56-66 % (llguidance; 64 rows, real weights,
    bench/results/h200/session36.md), on a 2-core Zen 4 engine from 93.6 to 96.4 % (session34.md).
    The other kinds go to xgrammar first, llguidance where xgrammar refuses: llguidance's structural tags
    took 15-50 ms for some steps' masks on random weights."""
    takes = kind in LLGuidanceBackend.kinds
    if backend == "xgrammar" or not takes:
        return ("xgrammar",)
    if backend == "llguidance":
        return ("llguidance",)
    return ("llguidance", "xgrammar") if kind == "json" else ("xgrammar", "llguidance")


_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")

_NAMES = {"json": "json schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
          "json_object": "json object grammar", "structural_tag": "structural tag"}


class Grammars:
    """One engine's structured outputs: compiles specs for the model's tokenizer (keeping the compiled
    ones), gives each sample its matcher, advances it, and fills the step's token masks."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: Sequence[int], max_rows: int,
                 pin_memory: bool = False, check_first_seconds: float = CHECK_FIRST_SECONDS, backend: str = "auto",
                 thread: bool = False):
        """check_first_seconds: the host time a step's masks may cost before rows that sample plainly check
        their draws first (engine/grammar_step.py's CheckFirstPolicy; 0: always check). backend: the
        engine's structured_outputs_backend (see backend_order). thread: steps whose rows are all under
        llguidance take their tokens and fill their masks on the grammar thread (engine/grammar_thread.py)."""
        if backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, "
                             f"not {backend!r}")
        self.backend = backend
        self._model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._max_rows = max_rows
        self._pin = pin_memory
        self._tokenizer = None
        self._xgrammar: Optional[XgrammarBackend] = None
        self._llguidance: Optional[LLGuidanceBackend | str] = None  # or why llguidance cannot be used
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._bitmask: Optional[torch.Tensor] = None
        self._words = (vocab_size + 31) // 32  # a mask row's int32 words
        pool = GrammarPool(grammar_pool_threads())  # llguidance's accepts and masks, on either thread
        self._thread = GrammarThread(max_rows, self._words, pin_memory, pool) if thread else None
        self._thread_takes: dict[int, int] = {}  # id() of the matchers whose latest step's tokens the thread takes
        self._filler = MaskFiller(min(os.cpu_count() or 1, _FILL_THREADS), pool)
        self._ended: list[tuple[object, object]] = []  # (request, sample) whose grammar terminated
        self.stats = GrammarStats()
        self.policy = CheckFirstPolicy(check_first_seconds)  # whether a step checks draws before masking

    def _hf_tokenizer(self):
        """The model's HF tokenizer, loaded once for both backends."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self._model_dir), local_files_only=True)
        return self._tokenizer

    def _xgrammar_backend(self) -> XgrammarBackend:
        if self._xgrammar is None:
            self._xgrammar = XgrammarBackend(self._hf_tokenizer(), self.vocab_size, self._eos)
        return self._xgrammar

    def _llguidance_backend(self) -> LLGuidanceBackend:
        """llguidance for this tokenizer; ValueError (each time) where it cannot read the tokenizer."""
        if self._llguidance is None:
            try:
                self._llguidance = LLGuidanceBackend(self._hf_tokenizer(), self.vocab_size, self._eos)
            except ValueError as err:
                self._llguidance = str(err)
        if isinstance(self._llguidance, str):
            raise ValueError(self._llguidance)
        return self._llguidance

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `spec` (cached); RequestError when it does not compile."""
        key = spec.cache_key()
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return compiled
        compiled = self._compile(spec)
        self._cache[key] = compiled
        if len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The first backend of backend_order that compiles the spec; RequestError naming each one's
        problem."""
        name, problems = _NAMES[spec.kind], []
        order = backend_order(self.backend, spec.kind)
        for backend in order:
            try:
                compiled = self._backend(backend).compile(spec)
            except RequestError:
                raise
            except ImportError:
                problems.append(f"{backend}: not installed")
                continue
            except Exception as err:  # xgrammar raises RuntimeError, ValueError, InvalidJSONError, ...
                problems.append(f"{backend}: {_first_line(err)}")
                continue
            if problems:
                logger.info("structured outputs: %s cannot compile the %s; %s compiled it", "; ".join(problems),
                            name, backend)
            else:
                logger.debug("structured outputs: the %s compiled with %s", name, backend)
            return compiled
        raise RequestError(f"structured_outputs: the {name} cannot be compiled: {'; '.join(problems)}",
                           "structured_outputs", "invalid_grammar")

    def _backend(self, name: str):
        return self._xgrammar_backend() if name == "xgrammar" else self._llguidance_backend()

    def attach(self, request, have_tokenizer: bool) -> None:
        """Compiles the request's spec (if any) and gives each of its samples (forks included) a matcher."""
        spec = request.params.structured_outputs
        if spec is None:
            return
        if not have_tokenizer:
            raise RequestError("structured_outputs needs the model's tokenizer", "structured_outputs",
                               "no_tokenizer")
        compiled = self.compile(spec)
        for sample in request.samples:
            sample.grammar = compiled.new_matcher()
            if isinstance(sample.grammar, LLGuidanceMatcher):  # the grammar thread reports it ended by it
                sample.grammar.owner = (weakref.ref(request), weakref.ref(sample))

    def accept(self, request, sample, token: int) -> None:
        """Advances the sample's matcher; one that terminates (its stop token accepted) or refuses the
        token ends the sample at take_ended()."""
        matcher = sample.grammar
        if id(matcher) in self._thread_takes:
            return  # the grammar thread takes it
        if not matcher.accept_token(token) or matcher.is_terminated():
            self._ended.append((request, sample))

    def take_ended(self) -> list:
        """The (request, sample) pairs whose grammar ended since the last call and whose sequence still
        runs (an EOS already ended most of them in the scheduler), each given its "stop" ending. The grammar
        thread's jobs but the newest are settled first: the tokens recorded now were drawn under their masks."""
        self.settle(keep_newest=True)
        if not self._ended:
            return []
        ended = [(r, s) for r, s in self._ended if s.seq_id is not None and not s.done]
        self._ended.clear()
        for _, sample in ended:
            sample.ending = ("stop", None)
        return ended

    def step(self, matchers: list[tuple[int, object]]) -> Optional[GrammarStep]:
        """The grammars of a step's (logits row, matcher) pairs for the sampler; None when there are none.
        Called once a step, after the last step's tokens were recorded."""
        self._thread_takes = {}
        if not matchers:
            return None
        # The thread's masks cost the engine's thread little, so it takes every step it can keep up with: its
        # rows all llguidance's, their masks not dear (strings of bounded length are: checking draws pays there).
        if (self._thread is not None and not self.policy.dear(len(matchers))
                and all(isinstance(m, LLGuidanceMatcher) for _, m in matchers)):
            return GrammarStep(self.fill, matchers, self.stats, self.policy, False, (self.fill_threaded, self._drawn))
        self.settle()  # the thread's jobs moved some of these matchers: they end before this thread reads them
        return GrammarStep(self.fill, matchers, self.stats, self.policy, self.policy.decide(len(matchers)))

    @property
    def thread_takes_step(self) -> bool:
        """Whether the grammar thread takes the tokens of the step whose draw was queued last."""
        return bool(self._thread_takes)

    def _drawn(self, matchers: list[tuple[int, object]], pending) -> None:
        """The step's plain draw is queued: its tokens go to the grammar thread, not through accept()."""
        self._thread_takes = self._thread.submit(matchers, pending).row_of  # keyed by id(matcher)

    def fill_threaded(self, matchers: list[tuple[int, object]]) -> Optional[GrammarMask]:
        """The mask of a plain draw the grammar thread takes next (GrammarStep.drawn): where these pairs are
        its newest job's, that job's buffer, which the draw waits for on its device (the job stays in
        flight: the draw's own job queues behind it); else fill()'s."""
        newest = self._thread.newest
        if not lines_up(newest, matchers):
            return self.fill(matchers)
        self.stats.steps_waited_on_device += 1
        return GrammarMask(newest.buffer, [row for row, _ in matchers], self._thread.ready(newest))

    def fill(self, matchers: list[tuple[int, object]]) -> Optional[GrammarMask]:
        """The mask of these (logits row, matcher) pairs, the grammar thread's jobs settled first (they moved
        these matchers and filled most masks); None when none needs one (all terminated)."""
        start = time.perf_counter()
        if self._thread is None:
            bitmask, placed, todo = self._host_bitmask(), [], matchers
        else:
            newest = self._thread.newest
            self.settle()
            bitmask, placed, todo = place_masks(newest, matchers, self._thread.buffer())
        live = [(row, matcher) for row, matcher in todo if not matcher.is_terminated()]
        self._filler.fill(live, bitmask)
        rows = placed + [row for row, _ in live]
        self.stats.mask_seconds += time.perf_counter() - start
        self.stats.rows_filled += len(live)
        return GrammarMask(bitmask, rows) if rows else None

    def _host_bitmask(self) -> torch.Tensor:
        if self._bitmask is None:
            self._bitmask = torch.full((self._max_rows, self._words), -1, dtype=torch.int32, pin_memory=self._pin)
        return self._bitmask

    def _note_job(self, job) -> None:
        """A settled job's cost and the samples whose grammar it ended (stopped at take_ended())."""
        self.stats.thread_seconds += job.seconds
        self.stats.rows_filled += len(job.rows)  # the ended matchers' masks too (an EOS-only mask each)
        self.policy.note_fill(len(job.rows), job.seconds)  # masks dear enough to check draws first: not here
        for matcher in job.ended:
            if matcher.owner is None:  # made outside attach(): nothing to end
                continue
            request, sample = (ref() for ref in matcher.owner)
            if request is not None and sample is not None:
                self._ended.append((request, sample))

    def settle(self, keep_newest: bool = False) -> None:
        """The grammar thread's jobs (all, or all but the newest) done and noted: their matchers the engine's
        again, the samples they ended queued for take_ended()."""
        if self._thread is not None:
            for job in self._thread.settle(keep_newest):
                self._note_job(job)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()


def _first_line(err: Exception) -> str:
    """The gist of a backend's error: its first line, less xgrammar's "[12:00:00] /project/cpp/file.cc:83: "
    source prefix and "Check failed: (...) is false: " preamble; a first line that ends in ":" (llguidance's
    "regex parse error:") gets its later "error: ..." line."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    first = _SOURCE_PREFIX.sub("", lines[0])
    first = first.split(" is false: ", 1)[1] if first.startswith("Check failed:") and " is false: " in first else first
    if first.endswith(":"):
        detail = next((line for line in lines[1:] if line.startswith("error:")), None)
        first = f"{first} {detail}" if detail else first
    return first


