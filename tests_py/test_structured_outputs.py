"""Structured outputs through the offline LLM API (default model, CPU): JSON schemas, regex,
choice, EBNF grammars and json_object, with n > 1, forced preemption, prefix caching and
max_tokens reached mid-structure. The outputs are checked by independent parsers (json,
jsonschema, re), not by the grammar engine that constrained them."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from pagedserve.errors import RequestError

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                 "minItems": 2, "maxItems": 4}},
     "required": ["colors"]},
    {"type": "object", "properties": {"size": {"enum": ["small", "medium", "large"]}}, "required": ["size"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}},
     "required": ["value"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 50}},
     "required": ["temperature"]},
    {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 15},
                                                    "last": {"type": "string", "maxLength": 15}},
                   "required": ["first", "last"], "additionalProperties": False}},
     "required": ["person"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 5},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "maxItems": 3}},
     "required": ["id", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0,
                                                                             "maximum": 10}},
     "required": ["status", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "array", "items": {"type": "number"}, "minItems": 2,
                                                "maxItems": 2}}, "required": ["point"]},
    {"type": "object", "properties": {"animal": {"type": "string", "enum": ["cat", "dog"]},
                                      "legs": {"type": "integer", "enum": [2, 4]}},
     "required": ["animal", "legs"], "additionalProperties": False},
    {"type": "object", "properties": {"item": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "book"}, "pages": {"type": "integer", "minimum": 1,
                                                                                "maximum": 2000}},
         "required": ["kind", "pages"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "pen"}}, "required": ["kind"],
         "additionalProperties": False}]}}, "required": ["item"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
     "required": ["score"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "minItems": 1, "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 2}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "minLength": 3, "maxLength": 20},
                                      "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
     "required": ["title", "year"], "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
                                      "active": {"type": "boolean"}},
     "required": ["email", "active"], "additionalProperties": False},
]

PROMPT = "Answer with JSON only. Describe an example record:\n"


def _json(schema: dict, **kw) -> SamplingParams:
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return SamplingParams(structured_outputs=so, **{"max_tokens": 96, "temperature": 0.0, **kw})


@pytest.fixture(scope="module")
def llm(default_model_path):
    return LLM(str(default_model_path), dtype="float32", device="cpu", seed=0, max_model_len=1024)


def test_params_validation():
    with pytest.raises(RequestError) as err:
        StructuredOutputsParams()
    assert err.value.field == "structured_outputs"
    with pytest.raises(RequestError):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(RequestError):
        StructuredOutputsParams(choice=[])
    with pytest.raises(RequestError, match="needs structures and triggers"):
        StructuredOutputsParams(structural_tag={"type": "structural_tag"})
    params = SamplingParams(structured_outputs={"regex": "[0-9]+"})  # a dict is taken as the params
    assert params.structured_outputs.regex == "[0-9]+"


def test_uncompilable_is_a_request_error(llm):
    for so in (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
               StructuredOutputsParams(regex="(unclosed"), StructuredOutputsParams(grammar="root ::= missing_rule")):
        with pytest.raises(RequestError) as err:
            llm.generate(["x"], SamplingParams(structured_outputs=so), use_tqdm=False)
        assert err.value.field == "structured_outputs"
    assert not llm.llm_engine.has_unfinished_requests()


def test_json_schemas_validate(llm):
    assert len(SCHEMAS) >= 20
    outs = llm.generate([PROMPT] * len(SCHEMAS), [_json(s) for s in SCHEMAS], use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_json_schema_sampled_with_whitespace(llm):
    """Sampling (not greedy), vLLM's default whitespace, n = 2: each sample its own matcher."""
    schema = SCHEMAS[1]
    so = StructuredOutputsParams(json=schema)
    outs = llm.generate([PROMPT] * 3, SamplingParams(structured_outputs=so, n=2, temperature=0.8, seed=1,
                                                     max_tokens=128), use_tqdm=False)
    texts = set()
    for out in outs:
        assert len(out.outputs) == 2
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), schema)
            texts.add(c.text)
    assert len(texts) > 1


def test_regex_choice_grammar_json_object(llm):
    regex = r"[A-Z][a-z]{2,6} [0-9]{1,3}"
    choices = ["Paris", "London", "Berlin"]
    grammar = 'root ::= "(" num " + " num ")" \nnum ::= [1-9] [0-9]?'
    params = [
        SamplingParams(max_tokens=32, temperature=0.7, n=2, structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(max_tokens=32, temperature=0.7, n=2, structured_outputs=StructuredOutputsParams(choice=choices)),
        SamplingParams(max_tokens=32, temperature=0.7, structured_outputs=StructuredOutputsParams(grammar=grammar)),
        SamplingParams(max_tokens=128, temperature=0.0, repetition_penalty=1.3,
                       structured_outputs=StructuredOutputsParams(json_object=True)),
    ]
    prompts = ["A name and a number:", "The capital of France is", "A sum:", "A JSON object with a cat's name and age:"]
    regex_out, choice_out, grammar_out, obj_out = llm.generate(prompts, params, use_tqdm=False)
    for c in regex_out.outputs:
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
    for c in choice_out.outputs:
        assert c.finish_reason == "stop" and c.text in choices, c.text
    assert re.fullmatch(r"\([1-9][0-9]? \+ [1-9][0-9]?\)", grammar_out.outputs[0].text)
    c = obj_out.outputs[0]
    assert c.finish_reason == "stop" and isinstance(json.loads(c.text), dict), c.text


def test_max_tokens_mid_structure_is_length(llm):
    out = llm.generate([PROMPT], _json(SCHEMAS[0], max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 5
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_mixed_batch_leaves_unconstrained_rows_alone(llm):
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    alone = llm.generate([PROMPT], plain, use_tqdm=False)[0].outputs[0].text
    mixed = llm.generate([PROMPT, PROMPT], [_json(SCHEMAS[0]), plain], use_tqdm=False)
    assert mixed[1].outputs[0].text == alone
    jsonschema.validate(json.loads(mixed[0].outputs[0].text), SCHEMAS[0])


def test_prefix_caching(llm):
    """The second pass finds the prompt cached; the constrained outputs stay valid (and identical, greedy)."""
    prompt = PROMPT * 4  # several full blocks
    first = llm.generate([prompt], _json(SCHEMAS[7]), use_tqdm=False)[0]
    second = llm.generate([prompt], _json(SCHEMAS[7]), use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].text == first.outputs[0].text
    jsonschema.validate(json.loads(second.outputs[0].text), SCHEMAS[7])


def test_forced_preemption(default_model_path):
    """A KV pool too small for the batch: sequences are preempted and recomputed; their matchers keep
    their state (the tokens are kept), so the outputs still parse and equal the unpreempted ones."""
    schemas = SCHEMAS[:6]
    roomy = LLM(str(default_model_path), dtype="float32", device="cpu", seed=0, max_model_len=256)
    prompt = PROMPT * 3
    expected = [o.outputs[0].text for o in roomy.generate([prompt] * 6, [_json(s) for s in schemas],
                                                          use_tqdm=False)]
    del roomy
    tight = LLM(str(default_model_path), dtype="float32", device="cpu", seed=0, max_model_len=192,
                num_kv_blocks=48, block_size=4, enable_prefix_caching=False)
    outs = tight.generate([prompt] * 6, [_json(s) for s in schemas], use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for schema, out, text in zip(schemas, outs, expected):
        c = out.outputs[0]
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)
        assert c.text == text


def test_sampler_mask_only_touches_its_rows():
    """The sampler applies a bitmask to the rows it names, on a copy; other rows sample as before."""
    import torch
    import xgrammar as xgr

    from pagedserve.sample.grammar_mask import GrammarMask
    from pagedserve.sample.sampler import Sampler, SamplingRow

    vocab = 100
    sampler = Sampler("cpu", vocab, eos_token_ids=[0], seed=0)
    logits = torch.randn(3, vocab + 28)  # the model's logits may be wider than the vocabulary
    before = logits.clone()
    bitmask = xgr.allocate_token_bitmask(4, vocab)
    bitmask.zero_()
    bitmask[0, 1] = 1 << 3  # row 0: only token 35
    bitmask[2, 0] = 1 << 7  # row 2: only token 7
    greedy = SamplingParams(temperature=0.0)
    rows = [SamplingRow(greedy, 1, [1], []), SamplingRow(greedy, 1, [1], []),
            SamplingRow(SamplingParams(temperature=1.0, top_p=0.9), 1, [1], [])]
    out = sampler.launch(logits, rows, GrammarMask(bitmask, [0, 2])).result()
    assert out.token_ids[0] == 35 and out.token_ids[2] == 7
    assert out.token_ids[1] == int(logits[1, :vocab].argmax())
    assert torch.equal(logits, before)


def test_plain_rows_sample_the_mask_in_one_pass_as_the_masked_logits():
    """Rows that sample plainly (temperature or greedy) take the mask inside ops.sample_tokens: the draws
    equal those of the same sampler on logits masked to -inf first (xgrammar's apply), an unconstrained
    row ignores what an earlier step left in its bitmask row, and a row with nothing allowed gets 0."""
    import torch

    from pagedserve.sample.grammar_mask import GrammarMask, apply_mask
    from pagedserve.sample.sampler import Sampler, SamplingRow

    vocab, num_rows = 1000, 16
    logits = torch.randn(num_rows, vocab + 24)
    bitmask = torch.randint(-2**31, 2**31 - 1, (num_rows + 4, (vocab + 31) // 32), dtype=torch.int32)
    bitmask[3] = 0  # row 3: nothing allowed
    constrained = [r for r in range(num_rows) if r != 5]  # row 5's words are stale: it samples unmasked
    rows = [SamplingRow(SamplingParams(temperature=0.0 if r % 4 == 0 else 0.8), 1, [1], []) for r in range(num_rows)]
    for seed in range(5):
        fused = Sampler("cpu", vocab, eos_token_ids=[0], seed=seed).launch(
            logits, rows, GrammarMask(bitmask.clone(), constrained)).result().token_ids
        masked = apply_mask(logits[:, :vocab], GrammarMask(bitmask.clone(), constrained))
        expected = Sampler("cpu", vocab, eos_token_ids=[0], seed=seed).launch(masked, rows).result().token_ids
        assert fused == expected
        assert fused[3] == 0
        for r in constrained:
            if r != 3:
                assert (int(bitmask[r, fused[r] // 32]) >> (fused[r] % 32)) & 1, f"row {r} drew a forbidden token"


def test_grammar_end_ends_the_sequence_even_with_ignore_eos(llm):
    """ignore_eos keeps the scheduler going past EOS; the terminated grammar still ends the sample."""
    so = StructuredOutputsParams(choice=["yes", "no"])
    out = llm.generate(["Is water wet?"], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                          structured_outputs=so), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")
    assert len(out.token_ids) <= 3


def test_unbounded_numbers_get_the_interoperable_range():
    from pagedserve.engine.json_schemas import SAFE_INTEGER, bounded_numbers

    schema = {"type": "object", "properties": {
        "age": {"type": "integer"}, "x": {"type": "number", "minimum": 0},
        "kind": {"const": {"type": "integer"}}, "items": {"type": "array", "items": {"type": "integer", "maximum": 9}}}}
    out = bounded_numbers(schema)
    assert out["properties"]["age"] == {"type": "integer", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
    assert out["properties"]["x"] == {"type": "number", "minimum": 0, "maximum": SAFE_INTEGER}
    assert out["properties"]["kind"] == {"const": {"type": "integer"}}  # data, not a subschema
    assert out["properties"]["items"]["items"] == {"type": "integer", "maximum": 9, "minimum": -SAFE_INTEGER}
    assert schema["properties"]["age"] == {"type": "integer"}  # the caller's schema is left alone


def test_integer_digits_are_bounded(llm):
    compiled = llm.llm_engine.grammars.compile(StructuredOutputsParams(json={"type": "integer"}))
    tokenizer = llm.get_tokenizer()
    for text, ok in (("9007199254740991", True), ("90071992547409910", False)):
        matcher = compiled.new_matcher()
        accepted = all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
        assert accepted == ok, text
