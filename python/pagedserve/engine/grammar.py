"""Structured outputs: compiling a request's grammar and the per-step token bitmask.

xgrammar does the grammar work. `Grammars` (one per engine, its compiler built on
first use) turns a StructuredOutputsParams into a compiled grammar, cached by
the spec, when the request is added: a spec that does not compile is a
RequestError before the request is queued. Each sample of such a request
keeps its own xgrammar GrammarMatcher, advanced with every token the engine
records (LLMEngine._add_token). Forks (n > 1) fork at the first sampled
token: the row that forks is sampled under the shared initial state and each
sample's matcher, created with the request, accepts its own token. Preemption
by recompute keeps a sequence's tokens, so its matcher needs nothing.

Each step, `fill_bitmask` writes the next-token mask of the rows that have a
matcher into a host int32 bitmask ([max rows, ceil(vocab / 32)]), and the
sampler applies it to the logits (on their device) before any sampling
parameter. The stop tokens are allowed only where the grammar accepts, so
EOS ends a sequence only on a complete output.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Sequence

import torch

from pagedserve.errors import RequestError
from pagedserve.sample.grammar_mask import GrammarMask
from pagedserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger("pagedserve")

_CACHE_SIZE = 256


class Grammars:
    """One engine's structured outputs: compiles specs for the model's tokenizer (keeping the compiled
    ones), gives each sample its matcher, advances it, and fills the step's token masks."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: Sequence[int], max_rows: int,
                 pin_memory: bool = False):
        self._model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._max_rows = max_rows
        self._pin = pin_memory
        self._compiler = None
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._bitmask: Optional[torch.Tensor] = None
        self._ended: list[tuple[object, object]] = []  # (request, sample) whose grammar terminated
        self.mask_seconds = 0.0  # host time spent filling masks

    def _xgr_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(self._model_dir), local_files_only=True)
            # The model's logits may be wider than the tokenizer's vocabulary: size the masks by the model's.
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self._eos or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of `spec` (cached); RequestError when it does not compile."""
        key = spec.cache_key()
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return compiled
        compiler = self._xgr_compiler()
        try:
            compiled = _compile(compiler, spec)
        except RequestError:
            raise
        except Exception as err:  # xgrammar raises RuntimeError, ValueError, InvalidJSONError, ...
            msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise RequestError(f"structured_outputs: the {spec.kind} cannot be compiled: {msg}",
                               "structured_outputs", "invalid_grammar") from None
        self._cache[key] = compiled
        if len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
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
        import xgrammar as xgr

        for sample in request.samples:
            sample.grammar = xgr.GrammarMatcher(compiled)

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

    def fill_bitmask(self, matchers: list[tuple[int, object]]) -> Optional[GrammarMask]:
        """The mask for these (logits row, matcher) pairs; None when none needs one."""
        import xgrammar as xgr

        start = time.perf_counter()

        if self._bitmask is None:
            self._bitmask = xgr.allocate_token_bitmask(self._max_rows, self.vocab_size)
            if self._pin:
                self._bitmask = self._bitmask.pin_memory()
        rows = []
        for row, matcher in matchers:
            if matcher.is_terminated():
                continue
            matcher.fill_next_token_bitmask(self._bitmask, row)
            rows.append(row)
        self.mask_seconds += time.perf_counter() - start
        return GrammarMask(self._bitmask, rows) if rows else None


def _compile(compiler, spec: StructuredOutputsParams):
    kind = spec.kind
    if kind == "json":
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise RequestError(f"structured_outputs: the json schema is not valid JSON: {err}",
                                   "structured_outputs", "invalid_grammar") from None
        if not isinstance(schema, dict):
            raise RequestError("structured_outputs: the json schema must be a JSON object", "structured_outputs",
                               "invalid_grammar")
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=not spec.disable_any_whitespace,
                                            strict_mode=True)
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(spec.regex)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
        return compiler.compile_grammar(f"root ::= {alternatives}")
    if kind == "grammar":
        return compiler.compile_grammar(spec.grammar)
    raise RequestError(f"structured_outputs.{kind} is not supported yet", "structured_outputs", "unsupported")
