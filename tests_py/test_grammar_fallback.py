"""The two grammar backends and which one compiles: by default llguidance takes json schemas and xgrammar
the other kinds, each falling back to the other where it refuses (the engine's structured_outputs_backend
may name one); both matchers fill one bitmask; a spec every backend tried refuses is a RequestError naming
each problem, and a json schema with keywords llguidance does not implement (which xgrammar would ignore)
is one too. End to end on the default model (CPU); outputs checked by jsonschema and `regex`."""

from __future__ import annotations

import json

import jsonschema
import pytest
import regex
import torch

from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from pagedserve.errors import RequestError

# xgrammar refuses integer bounds that are not whole numbers (0.2.8 and 0.2.9), and 0.2.8 also a JSON
# pointer with an escaped "/" (~1); both are valid JSON Schema, which jsonschema checks independently.
FALLBACK_SCHEMA = {
    "type": "object",
    "properties": {"unit": {"$ref": "#/$defs/temperature~1unit"},
                   "count": {"type": "integer", "minimum": 0.5, "maximum": 9.5}},
    "required": ["unit", "count"], "additionalProperties": False,
    "$defs": {"temperature/unit": {"enum": ["celsius", "fahrenheit"]}},
}
UNICODE_REGEX = r"\p{Lu}\p{Ll}{2,8}"  # Unicode classes: xgrammar refuses them
LOOKAHEAD_SCHEMA = {"type": "string", "pattern": "^(?=c)cat$"}  # llguidance's regexes have no lookahead
PLAIN_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}


@pytest.fixture(scope="module")
def llm(default_model_path):
    return LLM(str(default_model_path), dtype="float32", device="cpu", seed=0, max_model_len=1024)


def _backend(llm, **spec) -> str:
    return llm.llm_engine.grammars.compile(StructuredOutputsParams(**spec)).backend


def test_default_backends_by_kind(llm):
    assert _backend(llm, json=PLAIN_SCHEMA) == "llguidance"
    assert _backend(llm, regex="[a-z]+") == "xgrammar"
    assert _backend(llm, grammar='root ::= "a" | "b"') == "xgrammar"
    assert _backend(llm, choice=["x", "y"]) == "xgrammar"
    assert _backend(llm, json_object=True) == "xgrammar"


def test_each_backend_falls_back_to_the_other(llm, caplog):
    grammars = llm.llm_engine.grammars
    with pytest.raises(Exception):
        grammars._xgrammar_backend().compile(StructuredOutputsParams(regex=UNICODE_REGEX))
    with pytest.raises(Exception):
        grammars._llguidance_backend().compile(StructuredOutputsParams(json=LOOKAHEAD_SCHEMA))
    with caplog.at_level("INFO", logger="pagedserve"):
        assert _backend(llm, regex=UNICODE_REGEX) == "llguidance"
        assert _backend(llm, json=LOOKAHEAD_SCHEMA) == "xgrammar"
    assert "llguidance compiled it" in caplog.text and "xgrammar compiled it" in caplog.text
    out = llm.generate(["Name an animal:"], SamplingParams(structured_outputs=StructuredOutputsParams(
        json=LOOKAHEAD_SCHEMA), max_tokens=8, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and json.loads(out.text) == "cat", out.text


@pytest.mark.parametrize("keyword", [{"uniqueItems": True}, {"not": {"const": [1]}}])
def test_schema_keywords_no_backend_enforces_are_refused(llm, keyword):
    """xgrammar compiles uniqueItems, not, if/then and dependentRequired but ignores them (it takes [1, 1]
    under uniqueItems); llguidance refuses them. The schema is a 400 naming them, not output that may
    break them."""
    schema = {"type": "array", "items": {"type": "integer"}, **keyword}
    xgr_matcher = llm.llm_engine.grammars._xgrammar_backend().compile(StructuredOutputsParams(json=schema)).new_matcher()
    tokens = llm.llm_engine.tokenizer.encode("[1, 1]", add_special_tokens=False)
    assert all(xgr_matcher.accept_token(t) for t in tokens)  # ignored
    with pytest.raises(RequestError, match=f"keywords that are not enforced here: .*{next(iter(keyword))}") as err:
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)
    assert (err.value.field, err.value.code) == ("structured_outputs", "invalid_grammar")
    assert not llm.llm_engine.has_unfinished_requests()


def test_fallback_schema_generates_valid_json(llm):
    so = StructuredOutputsParams(json=FALLBACK_SCHEMA, disable_any_whitespace=True)
    outs = llm.generate(["Answer with JSON only. How many?\n"] * 2,
                        [SamplingParams(structured_outputs=so, max_tokens=48, temperature=0.0),
                         SamplingParams(structured_outputs=so, max_tokens=48, temperature=0.9, seed=2, n=2)],
                        use_tqdm=False)
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), FALLBACK_SCHEMA)


def test_fallback_regex_generates_matching_text(llm):
    so = StructuredOutputsParams(regex=UNICODE_REGEX)
    out = llm.generate(["The capital of France is"], SamplingParams(structured_outputs=so, max_tokens=24,
                                                                      temperature=0.0), use_tqdm=False)[0]
    for c in out.outputs:
        assert c.finish_reason == "stop" and regex.fullmatch(UNICODE_REGEX, c.text), c.text


def test_mixed_backends_in_one_batch(llm):
    """Rows of both backends share the step's bitmask; each row gets its own grammar."""
    specs = [StructuredOutputsParams(json=PLAIN_SCHEMA, disable_any_whitespace=True),
             StructuredOutputsParams(json=FALLBACK_SCHEMA, disable_any_whitespace=True)]
    outs = llm.generate(["Answer with JSON only:\n"] * 2,
                        [SamplingParams(structured_outputs=s, max_tokens=48, temperature=0.0) for s in specs],
                        use_tqdm=False)
    jsonschema.validate(json.loads(outs[0].outputs[0].text), PLAIN_SCHEMA)
    jsonschema.validate(json.loads(outs[1].outputs[0].text), FALLBACK_SCHEMA)


def test_both_refusing_is_a_request_error_naming_both(llm):
    cases = [(StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 3}), "minimum"),
             (StructuredOutputsParams(regex="(unclosed"), "not closed"),
             (StructuredOutputsParams(grammar="root ::= missing_rule"), "missing_rule")]
    for so, problem in cases:
        with pytest.raises(RequestError) as err:
            llm.generate(["x"], SamplingParams(structured_outputs=so), use_tqdm=False)
        message = str(err.value)
        assert (err.value.field, err.value.code) == ("structured_outputs", "invalid_grammar")
        first, second = ("llguidance", "xgrammar") if so.kind == "json" else ("xgrammar", "llguidance")
        assert f"the {'json schema' if so.kind == 'json' else so.kind} cannot be compiled: {first}: " in message
        assert problem in message.split(f"; {second}:")[1 if second == "xgrammar" else 0], message
        assert f"; {second}: " in message, message
        assert "/project/cpp" not in message  # xgrammar's source location is dropped
    assert not llm.llm_engine.has_unfinished_requests()


def _allowed(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    words = bitmask[row].tolist()
    return {t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1}


def test_llguidance_matcher_fills_xgrammar_layout(llm):
    """Both backends' matchers, on one spec, allow the same tokens, in the same bitmask rows, through the
    shared interface (accept_token, is_terminated, fill_next_token_bitmask)."""
    engine = llm.llm_engine
    grammars = engine.grammars
    spec = StructuredOutputsParams(regex=r"(yes|no) [0-9]{2}")
    xgr_matcher = grammars._xgrammar_backend().compile(spec).new_matcher()
    llg_matcher = grammars._llguidance_backend().compile(spec).new_matcher()
    vocab = grammars.vocab_size
    bitmask = torch.zeros((2, (vocab + 31) // 32), dtype=torch.int32)
    for token in engine.tokenizer.encode("yes 42", add_special_tokens=False) + [None]:
        xgr_matcher.fill_next_token_bitmask(bitmask, 0)
        llg_matcher.fill_next_token_bitmask(bitmask, 1)
        assert _allowed(bitmask, 0, vocab) == _allowed(bitmask, 1, vocab)
        if token is not None:
            assert xgr_matcher.accept_token(token) and llg_matcher.accept_token(token)
    eos = engine.eos_token_ids[0]
    assert eos in _allowed(bitmask, 1, vocab)
    assert llg_matcher.accept_token(eos) and llg_matcher.is_terminated()
    refused = grammars._llguidance_backend().compile(spec).new_matcher()
    assert not refused.accept_token(engine.tokenizer.encode("maybe", add_special_tokens=False)[0])
    assert refused.is_terminated()  # a refused token ends it: the engine ends the sample


def test_mask_filler_writes_each_row_as_its_matcher_would(llm):
    """One step's batch fill (engine/grammar_backends.py MaskFiller: xgrammar's pool and llguidance's GrammarPool
    into one bitmask) writes, in each pair's row, what that matcher fills alone, and leaves the other rows."""
    from pagedserve._core.grammar import GrammarPool
    from pagedserve.engine.grammar_backends import MaskFiller

    engine = llm.llm_engine
    grammars = engine.grammars
    vocab = grammars.vocab_size
    specs = [StructuredOutputsParams(json=PLAIN_SCHEMA), StructuredOutputsParams(regex=r"(yes|no) [0-9]{2}")]
    matchers = [backend.compile(spec).new_matcher() for spec in specs
                for backend in (grammars._xgrammar_backend(), grammars._llguidance_backend())]
    prefixes = ['{"name": "Al', "yes"]
    for i, matcher in enumerate(matchers):
        for token in engine.tokenizer.encode(prefixes[i // 2], add_special_tokens=False):
            assert matcher.accept_token(token)
    pairs = [(5, matchers[0]), (0, matchers[1]), (2, matchers[2]), (6, matchers[3])]  # rows out of order
    batch = torch.full((8, (vocab + 31) // 32), -1, dtype=torch.int32)
    MaskFiller(2, GrammarPool(2)).fill(pairs, batch)
    alone = torch.zeros((1, batch.shape[1]), dtype=torch.int32)
    for row, matcher in pairs:
        matcher.fill_next_token_bitmask(alone, 0)
        assert torch.equal(batch[row], alone[0]), row
        assert 0 < len(_allowed(batch, row, vocab)) < vocab
    assert all(bool((batch[row] == -1).all()) for row in (1, 3, 4, 7))


LAYOUT_SCHEMA = {"type": "object", "properties": {
    "a": {"type": "array", "items": {"type": "integer"}},
    "properties": {"type": "object", "properties": {"b": {"type": "boolean"}}},  # a property named so
    "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
    "x": {"type": "number"}}, "required": ["a"]}
LAYOUT_TEXTS = ['{"a": [1, 2]}', '{"a":[1,2]}', '{ "a" : [ 1 , 2 ] }', '{\n  "a": [\n    1\n  ]\n}',
                '{"a":' + " " * 24 + '[1]}', '{"a":' + " " * 25 + '[1]}', '{"a":\n\n\n' + " " * 22 + "[1]}",
                '{"a": [1], "extra": 2}', '{"a": [1], "properties": {"b": true}}',
                '{"a": [1], "properties": {"b": true, "c": 1}}', '{"a": [1], "pair": [1, "x"]}',
                '{"a": [1], "pair": [1, "x", 3]}', '{"a": [1], "x": -21.837465}', '{"a": [1], "x": 21.8374659}']


@pytest.mark.parametrize("compact", [False, True])
def test_llguidance_json_is_laid_out_as_xgrammar_lays_it_out(llm, compact):
    """Where llguidance stands in for xgrammar on a JSON schema, it takes the texts xgrammar takes: whitespace
    runs bounded as MAX_WHITESPACE_RUN bounds them (a small model cannot loop on newlines), xgrammar's compact
    separators, strict mode's closed objects and tuples (a property named "properties" included), and
    fractions of at most 6 digits (where a small model loops otherwise)."""
    engine = llm.llm_engine
    grammars = engine.grammars
    spec = StructuredOutputsParams(json=LAYOUT_SCHEMA, disable_any_whitespace=compact)
    verdicts = []
    for text in LAYOUT_TEXTS:
        tokens = engine.tokenizer.encode(text, add_special_tokens=False) + [engine.eos_token_ids[0]]
        pair = []
        for backend in (grammars._xgrammar_backend(), grammars._llguidance_backend()):
            matcher = backend.compile(spec).new_matcher()
            pair.append(all(matcher.accept_token(t) for t in tokens))
        assert pair[0] == pair[1], (text, pair)
        verdicts.append(pair[0])
    assert True in verdicts and False in verdicts  # each layout has texts it takes and texts it refuses


def test_llguidance_is_not_used_where_it_misreads_the_tokenizer(default_model_path, tmp_path):
    """The default model's tokenizer as transformers 5.17 writes it from the GGUF file (a byte-level BPE
    whose decoder is a Sequence): llguidance would read "Ġ" as itself rather than a space and refuse valid
    JSON. It is not used there: what only llguidance could compile is a 400 saying why; xgrammar still
    serves the rest."""
    import shutil

    for f in default_model_path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "config.json":
            shutil.copy(f, tmp_path / f.name)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}
    spec["model"]["byte_fallback"] = True
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    from transformers import AutoTokenizer

    from pagedserve.engine.grammar import Grammars

    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    grammars = Grammars(tmp_path, len(tokenizer), [tokenizer.eos_token_id], max_rows=4)
    with pytest.raises(RequestError, match="llguidance reads this tokenizer differently from transformers"):
        grammars.compile(StructuredOutputsParams(regex=UNICODE_REGEX))
    assert grammars.compile(StructuredOutputsParams(json=PLAIN_SCHEMA)).backend == "xgrammar"
    with pytest.raises(RequestError, match="llguidance reads this tokenizer differently"):  # the finding is kept
        grammars.compile(StructuredOutputsParams(json=FALLBACK_SCHEMA))


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_structured_outputs_backend_names_the_backend(default_model_path, backend):
    """structured_outputs_backend "xgrammar" is xgrammar alone (it ignores what it does not enforce, as asked);
    "llguidance" is llguidance for the kinds it takes, xgrammar for those it has no form of."""
    from transformers import AutoTokenizer

    from pagedserve.engine.grammar import Grammars

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path))
    grammars = Grammars(default_model_path, len(tokenizer), [tokenizer.eos_token_id], max_rows=1, backend=backend)
    compiled = lambda **spec: grammars.compile(StructuredOutputsParams(**spec)).backend  # noqa: E731
    assert compiled(json=PLAIN_SCHEMA) == backend
    assert compiled(choice=["x", "y"]) == compiled(json_object=True) == "xgrammar"
    refused = {"regex": UNICODE_REGEX} if backend == "xgrammar" else {"json": LOOKAHEAD_SCHEMA}  # the other takes it
    with pytest.raises(RequestError) as err:
        grammars.compile(StructuredOutputsParams(**refused))
    message = str(err.value)
    other = "llguidance" if backend == "xgrammar" else "xgrammar"
    assert f"cannot be compiled: {backend}: " in message and f"{other}:" not in message, message
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    if backend == "xgrammar":
        assert compiled(json=unique) == "xgrammar"
    else:
        assert compiled(regex="[a-z]+") == "llguidance"
        with pytest.raises(RequestError, match="not enforced here"):
            grammars.compile(StructuredOutputsParams(json=unique))


def test_structured_outputs_backend_reaches_the_engine(default_model_path):
    from pagedserve.engine.grammar import Grammars

    with pytest.raises(ValueError, match="structured_outputs_backend must be one of auto, xgrammar, llguidance"):
        Grammars(default_model_path, 49152, [2], max_rows=1, backend="outlines")
    llm = LLM(str(default_model_path), device="cpu", max_model_len=256, structured_outputs_backend="xgrammar")
    assert llm.llm_engine.info().structured_outputs_backend == "xgrammar"
    assert _backend(llm, json=PLAIN_SCHEMA) == "xgrammar"
