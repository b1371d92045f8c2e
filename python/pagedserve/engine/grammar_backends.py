"""The two grammar engines behind structured outputs, xgrammar and llguidance.

xgrammar compiles every kind but refuses some schemas and regexes (Unicode classes such as \\p{L}, JSON
pointers with escapes like "#/$defs/a~1b", integer bounds given as 0.5, ...); llguidance compiles json
schemas, regexes, grammars and legacy structural tags, another subset. Which one a spec goes to first is
pagedserve.engine.grammar's choice (backend_order); this module compiles, and fills a step's masks.

Both backends give `CompiledGrammar`s whose `new_matcher()` matchers share one interface, the one of
xgrammar's GrammarMatcher that the engine already uses:

- accept_token(token) -> bool: advances; False when the grammar refuses the token (and stays put);
- is_terminated() -> bool: the grammar has ended (its stop token accepted, or no token can follow);
- fill_next_token_bitmask(bitmask, row): writes the allowed next tokens into row `row` of an int32
  bitmask [rows, ceil(vocab / 32)] (bit t % 32 of word t // 32), the layout both libraries use, so
  the sampler applies either's mask the same way.

`accepts(matcher, token)` asks whether a matcher of either backend would take a token, leaving it as it is.
"""

from __future__ import annotations

import json
import os
from copy import copy
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from pagedserve.engine import structural_tag
from pagedserve.engine.json_schemas import as_xgrammar_reads_it, json_schema_text
from pagedserve.errors import RequestError
from pagedserve.sampling_params import StructuredOutputsParams

# The longest whitespace run allowed between two JSON tokens: enough for any sane indentation (a newline and
# 8 levels of 2-3 spaces), short enough that a small model cannot loop on newlines until max_tokens (SmolLM2-135M
# did, greedily, with unbounded whitespace). llama.cpp bounds its JSON grammars the same way (20 spaces).
MAX_WHITESPACE_RUN = 24


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled spec: which backend compiled it, and how to make a fresh matcher for one sample."""

    backend: str  # "xgrammar" or "llguidance"
    new_matcher: Callable[[], object]


class XgrammarBackend:
    """Compiles every kind with xgrammar; its GrammarMatcher is the matcher as is."""

    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        import xgrammar as xgr

        # The model's logits may be wider than the tokenizer's vocabulary: size the masks by the model's.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(eos_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Raises whatever xgrammar raises (RuntimeError, ValueError, InvalidJSONError, ...), or
        RequestError for a json schema that is not a JSON object."""
        import xgrammar as xgr

        compiled = self._compile(spec)
        return CompiledGrammar(self.name, lambda: xgr.GrammarMatcher(compiled))

    def _compile(self, spec: StructuredOutputsParams):
        compiler, kind = self._compiler, spec.kind
        if kind == "json":
            free = not spec.disable_any_whitespace
            return compiler.compile_json_schema(json_schema_text(spec), any_whitespace=free, strict_mode=True,
                                                max_whitespace_cnt=MAX_WHITESPACE_RUN if free else None)
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        if kind == "grammar":
            return compiler.compile_grammar(spec.grammar)
        if kind == "structural_tag":
            return compiler.compile_structural_tag(structural_tag.to_xgrammar(spec.structural_tag))
        raise ValueError(f"unknown structured output kind {kind}")


class LLGuidanceBackend:
    """Compiles json schemas, regexes, grammars (GBNF or Lark) and legacy structural tags with llguidance.
    A spec is compiled once into a template matcher; each sample gets a deep copy (cheaper than building
    one)."""

    name = "llguidance"
    kinds = ("json", "regex", "grammar", "structural_tag")  # structural tags: the legacy form only

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        """ValueError where llguidance's C API cannot be loaded or reads the tokenizer differently from
        transformers (the engine then uses xgrammar alone)."""
        import llguidance._lib

        from pagedserve._core import grammar as core_grammar

        eos = list(eos_token_ids) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        backend = copy(tokenizer.backend_tokenizer)  # as llguidance.hf.from_tokenizer reads it
        backend.no_padding()
        backend.no_truncation()
        text = backend.to_str()
        # Where a grammar forces text, llguidance allows that text's own tokens, as the model's tokenizer splits
        # them: llguidance's Python tokenizer (the tokenizers crate) tokenizes for it (cpp/grammar/llguidance_api.h).
        py_tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos or None)
        self._tokenizer = core_grammar.LlgTokenizer(llguidance._lib.__file__, text, vocab_size, eos,
                                                    py_tokenizer.tokenize_bytes)
        _check_reads_alike(tokenizer, self._tokenizer)

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """ValueError (llguidance's message) when llguidance cannot compile the spec; RequestError for a
        json schema with keywords llguidance does not implement (uniqueItems, not, if/then,
        dependentRequired, ...): xgrammar, the other backend, compiles those but ignores them, and its output
        could break them."""
        from pagedserve._core import grammar as core_grammar

        template = core_grammar.LlgMatcher(self._tokenizer, self.grammar_text(spec))
        error = template.error
        if error is None:
            return CompiledGrammar(self.name, lambda: LLGuidanceMatcher(template.clone()))
        if spec.kind == "json" and error.startswith(_UNIMPLEMENTED):
            keys = error.splitlines()[0].removeprefix(_UNIMPLEMENTED).strip()
            raise RequestError(f"structured_outputs: the json schema uses keywords that are not enforced here: {keys}; "
                               f"remove them (xgrammar would ignore them, so it is not used)", "structured_outputs",
                               "invalid_grammar")
        raise ValueError(error)

    @staticmethod
    def grammar_text(spec: StructuredOutputsParams) -> str:
        """The llguidance grammar a spec compiles from (the probes under bench/perf/probes build matchers of it)."""
        import llguidance

        if spec.kind == "json":  # the JSON that xgrammar's settings (XgrammarBackend._compile) allow
            schema = json.dumps(as_xgrammar_reads_it(json.loads(json_schema_text(spec))))
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_llguidance_json_options(spec))
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.kind == "grammar":
            return llguidance.grammar_from("grammar", spec.grammar)  # GBNF converted to Lark, or Lark as is
        if spec.kind == "structural_tag":
            return _llguidance_structural_tag(spec.structural_tag)
        raise ValueError(f"llguidance is not used for {spec.kind}")


_UNIMPLEMENTED = "Unimplemented keys:"  # llguidance's words for schema keywords it does not implement
_PROBE = '{"name": "Zoë", "n": [1, 2]}\n\t- ok'


def _check_reads_alike(hf_tokenizer, ll_tokenizer) -> None:
    """ValueError unless llguidance reads the tokens of a probe text as transformers does. It guesses how
    tokens map to bytes from tokenizer.json's decoder: a byte-level BPE tokenizer whose decoder is a
    Sequence (as transformers 5.17 writes one converted from a GGUF file) it reads as SentencePiece, so "Ġ"
    stays "Ġ" where a space was meant and its masks refuse valid JSON. Our own GGUF conversions write the
    plain ByteLevel decoder (models/tokenizer_json.py); a model directory made elsewhere may still have it."""
    ids = hf_tokenizer.encode(_PROBE, add_special_tokens=False)
    expected = hf_tokenizer.decode(ids, clean_up_tokenization_spaces=False).encode("utf-8")
    got = ll_tokenizer.decode(ids)
    if got.strip() != expected.strip():
        raise ValueError(f"llguidance reads this tokenizer differently from transformers ({expected!r} as {got!r}); "
                         f"it is not used")


def _llguidance_json_options(spec: StructuredOutputsParams) -> dict:
    """llguidance's JSON layout as xgrammar writes it: whitespace runs of at most MAX_WHITESPACE_RUN between
    tokens (llguidance's own default is unbounded: the newline loops of small models), or, without free
    whitespace, xgrammar's compact separators ", " and ": " (llguidance's are "," and ":")."""
    if spec.disable_any_whitespace:
        return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return {"whitespace_flexible": True, "whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_WHITESPACE_RUN}}}"}


def _llguidance_structural_tag(tag: dict) -> str:
    """llguidance's grammar for a legacy structural tag: each structure triggered by the longest trigger
    that begins it (free text around the tags, as in xgrammar). Triggers are taken as plain text, not
    as special tokens (assume_special=False): "<tool_call>" is ordinary text for most tokenizers."""
    from llguidance import StructTag

    if "format" in tag:
        raise ValueError("llguidance takes only the legacy structural tag form (structures and triggers)")
    tags = []
    for item in tag["structures"]:
        trigger = max((t for t in tag["triggers"] if item["begin"].startswith(t)), key=len)
        schema = item["schema"] if isinstance(item["schema"], dict) else json.loads(item["schema"])
        tags.append(StructTag(trigger=trigger, begin=item["begin"], grammar=schema, end=item["end"]))
    return StructTag.to_grammar(tags, assume_special=False)


def accepts(matcher, token: int) -> bool:
    """Whether `matcher` would accept `token` next; the matcher is left as it was (xgrammar's accepts and
    rolls back: 1.4 us a JSON row on a Zen 4 core, less than a fifth of filling its mask)."""
    if isinstance(matcher, LLGuidanceMatcher):
        return matcher.accepts(token)
    if not matcher.accept_token(token):
        return False
    matcher.rollback(1)
    return True


class LLGuidanceMatcher:
    """llguidance's matcher (its C API, pagedserve._core.grammar.LlgMatcher: cpp/grammar/llguidance_api.h)
    behind xgrammar's GrammarMatcher interface (see the module docstring)."""

    def __init__(self, matcher):
        self._matcher = matcher
        self.owner: Optional[tuple] = None  # weak references to its (request, sample): Grammars.attach

    @property
    def raw(self):
        """The LlgMatcher itself (GrammarPool.run takes it)."""
        return self._matcher

    def accept_token(self, token: int) -> bool:
        return self._matcher.consume(token)

    def accepts(self, token: int) -> bool:
        """Whether the matcher would consume `token`, without consuming it."""
        return self._matcher.accepts(token)

    def is_terminated(self) -> bool:
        """Stopped (its EOS consumed, or nothing can follow) or in error (a refused token): no more masks."""
        return self._matcher.is_stopped()

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the row in place."""
        words = bitmask[row]
        _check_host_bitmask(bitmask)
        self._matcher.fill(words.data_ptr(), words.numel())

    @property
    def error(self) -> Optional[str]:
        return self._matcher.error


def _check_host_bitmask(bitmask: torch.Tensor) -> None:
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError("the bitmask must be a contiguous int32 CPU tensor")


def grammar_pool_threads() -> int:
    """Threads asked of the GrammarPool that takes llguidance's rows: a quarter of the cores (the pool takes
    at most four, the fastest on an H200 host's 16 cores: cpp/grammar/grammar_pool.h); one, the caller's, on
    machines of fewer than 8 cores, where the engine's own thread and torch's need them."""
    return max(1, (os.cpu_count() or 1) // 4)


class MaskFiller:
    """Fills a step's masks, each backend's rows in one call (pools made on first use): xgrammar's on
    `xgrammar_threads` threads of its BatchGrammarMatcher, which holds the GIL throughout; llguidance's on
    `pool`, a GrammarPool, which drops it. Rows of both backends share the bitmask."""

    def __init__(self, xgrammar_threads: int, pool):
        self._xgrammar_threads = xgrammar_threads
        self._xgrammar = None
        self._pool = pool

    def fill(self, pairs: Sequence[tuple[int, object]], bitmask: torch.Tensor) -> None:
        """Writes the mask of each (row, matcher) pair into its row of `bitmask` (contiguous int32, on the
        host); terminated matchers are the caller's to leave out."""
        xgr_rows, xgr_matchers, llg_rows, llg = [], [], [], []
        for row, matcher in pairs:
            if isinstance(matcher, LLGuidanceMatcher):
                llg_rows.append(row)
                llg.append(matcher.raw)
            else:
                xgr_rows.append(row)
                xgr_matchers.append(matcher)
        if llg:
            _check_host_bitmask(bitmask)
            self._pool.run(llg, None, llg_rows, bitmask.data_ptr(), bitmask.shape[0], bitmask.shape[1])
        if xgr_matchers:
            if self._xgrammar is None:
                import xgrammar as xgr

                self._xgrammar = xgr.BatchGrammarMatcher(max_threads=self._xgrammar_threads)
            self._xgrammar.batch_fill_next_token_bitmask(xgr_matchers, bitmask, xgr_rows)
