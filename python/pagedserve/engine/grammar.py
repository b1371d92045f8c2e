"""Structured outputs: compiling a request's grammar and the per-step token bitmask.

`Grammars` (one per engine, its backends built on first use) turns a StructuredOutputsParams into a
compiled grammar, cached by the spec, when the request is added: a spec that does not compile is a
RequestError before the request is queued. xgrammar compiles it; where xgrammar refuses a json
schema, regex, grammar or legacy structural tag, llguidance tries (pagedserve.engine.grammar_backends
has both, behind one matcher interface), and only when both refuse is the spec an error, naming both
problems. Which backend compiled is logged and kept on the compiled grammar (`compile(spec).backend`).

Each sample of such a request keeps its own matcher, advanced with every token the engine records
(TokenRecorder._add_token). Forks (n > 1) fork at the first sampled token: the row that forks is sampled
under the shared initial state and each sample's matcher, created with the request, accepts its own
token. Preemption by recompute keeps a sequence's tokens, so its matcher needs nothing.

Each step, `step` hands the sampler the rows that have a matcher (engine/grammar_step.py). Their
next-token masks are written into a host int32 bitmask ([max rows, ceil(vocab / 32)], one layout for both
backends) and applied to the logits (on their device) before any sampling parameter: for every row, or,
where the sampler draws each row alone and checking pays (masks dear, or draws rarely refused), only for
the rows whose unmasked draw the grammar refuses. The stop tokens are allowed only where the grammar accepts, so EOS ends a sequence only on
a complete output.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Sequence

import torch

from pagedserve.engine.grammar_backends import CompiledGrammar, LLGuidanceBackend, XgrammarBackend
from pagedserve.engine.grammar_step import CHECK_FIRST_SECONDS, CheckFirstPolicy, GrammarStats, GrammarStep
from pagedserve.errors import RequestError
from pagedserve.sample.grammar_mask import GrammarMask
from pagedserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger("pagedserve")

_CACHE_SIZE = 256

# Threads filling a step's masks: 64 masks took 1.08-1.77 / 0.86-1.14 / 0.51-0.65 / 0.46-0.54 / 0.62-0.69 ms
# on 1 / 2 / 4 / 8 / 16 threads of an H200 host's 16 cores (structured_bench.py's fill scaling, four runs):
# past 8, the pool's overhead outgrows the work.
_FILL_THREADS = 8

_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")

_NAMES = {"json": "json schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
          "json_object": "json object grammar", "structural_tag": "structural tag"}


class Grammars:
    """One engine's structured outputs: compiles specs for the model's tokenizer (keeping the compiled
    ones), gives each sample its matcher, advances it, and fills the step's token masks."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: Sequence[int], max_rows: int,
                 pin_memory: bool = False, check_first_seconds: float = CHECK_FIRST_SECONDS):
        """check_first_seconds: the host time a step's masks may cost before rows that sample plainly check
        their draws first (engine/grammar_step.py's CheckFirstPolicy; 0: always check)."""
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
        self._batch_filler = None  # xgrammar's BatchGrammarMatcher, made on first use
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
        """xgrammar, else (for the kinds it takes) llguidance; RequestError naming both problems."""
        name = _NAMES[spec.kind]
        try:
            compiled = self._xgrammar_backend().compile(spec)
            logger.debug("structured outputs: the %s compiled with xgrammar", name)
            return compiled
        except RequestError:
            raise
        except Exception as err:  # xgrammar raises RuntimeError, ValueError, InvalidJSONError, ...
            xgr_problem = _first_line(err)
        if spec.kind not in LLGuidanceBackend.kinds:
            raise _not_compiled(name, f"xgrammar: {xgr_problem}")
        try:
            compiled = self._llguidance_backend().compile(spec)
        except ImportError:
            raise _not_compiled(name, f"xgrammar: {xgr_problem} (llguidance is not installed)") from None
        except Exception as err:
            raise _not_compiled(name, f"xgrammar: {xgr_problem}; llguidance: {_first_line(err)}") from None
        logger.info("structured outputs: xgrammar cannot compile the %s (%s); llguidance compiled it", name,
                    xgr_problem)
        return compiled

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

    def accept(self, request, sample, token: int) -> None:
        """Advances the sample's matcher; one that terminates (its stop token accepted) or refuses the
        token ends the sample at take_ended()."""
        matcher = sample.grammar
        if not matcher.accept_token(token) or matcher.is_terminated():
            self._ended.append((request, sample))

    def take_ended(self) -> list:
        """The (request, sample) pairs whose grammar ended since the last call and whose sequence still
        runs (an EOS already ended most of them in the scheduler), each given its "stop" ending."""
        if not self._ended:
            return []
        ended = [(r, s) for r, s in self._ended if s.seq_id is not None and not s.done]
        self._ended.clear()
        for _, sample in ended:
            sample.ending = ("stop", None)
        return ended

    def step(self, matchers: list[tuple[int, object]]) -> Optional[GrammarStep]:
        """The grammars of a step's (logits row, matcher) pairs for the sampler; None when there are none."""
        if not matchers:
            return None
        return GrammarStep(self.fill, matchers, self.stats, self.policy)

    def fill(self, matchers: list[tuple[int, object]]) -> Optional[GrammarMask]:
        """The mask of these (logits row, matcher) pairs; None when none needs one (all terminated)."""
        start = time.perf_counter()
        if self._bitmask is None:
            words = (self.vocab_size + 31) // 32
            self._bitmask = torch.full((self._max_rows, words), -1, dtype=torch.int32,
                                       pin_memory=self._pin)
        import xgrammar as xgr

        rows, batch, batch_rows = [], [], []
        for row, matcher in matchers:
            if matcher.is_terminated():
                continue
            if isinstance(matcher, xgr.GrammarMatcher):
                batch.append(matcher)
                batch_rows.append(row)
            else:
                matcher.fill_next_token_bitmask(self._bitmask, row)
            rows.append(row)
        if batch:  # xgrammar's matchers in one call, on its own threads
            if self._batch_filler is None:
                self._batch_filler = xgr.BatchGrammarMatcher(max_threads=min(os.cpu_count() or 1, _FILL_THREADS))
            self._batch_filler.batch_fill_next_token_bitmask(batch, self._bitmask, batch_rows)
        self.stats.mask_seconds += time.perf_counter() - start
        self.stats.rows_filled += len(rows)
        return GrammarMask(self._bitmask, rows) if rows else None


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


def _not_compiled(name: str, problems: str) -> RequestError:
    return RequestError(f"structured_outputs: the {name} cannot be compiled: {problems}", "structured_outputs",
                        "invalid_grammar")
